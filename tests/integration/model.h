/*
 * model.h - the synthetic model every end-to-end suite exports: each element
 * of a key's unsharded original is a pure function of the key's name and the
 * element's index, so any process can build its shards and check what it
 * owns without exchanging the data.
 */
#ifndef SP_TEST_MODEL_H
#define SP_TEST_MODEL_H

#include <stddef.h>
#include <stdint.h>

/* Element i (row-major) of the original of the key named name, es bytes. */
void model_element(const char *name, uint64_t i, size_t es, uint8_t *out);

/* The rows of dim-0 shards held by the ranks before rank. */
int64_t model_rows_before(const int64_t *parts, uint32_t rank);

#endif /* SP_TEST_MODEL_H */
