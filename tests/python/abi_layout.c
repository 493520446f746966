/*
 * abi_layout.c - prints the public structs' sizes and field offsets and the
 * header's constants as JSON, so that test_client.py can check the Python
 * package's ctypes mirror (client/python/shardport/_lib.py) against the
 * header it must repeat field for field.
 */
#include <stddef.h>
#include <stdio.h>

#include "shardport.h"

static int first_struct = 1;

static void begin(const char *name, size_t size) {
  printf("%s\n  \"%s\": {\"size\": %zu", first_struct ? "" : ",", name,
         size);
  first_struct = 0;
}

#define BEGIN(T) begin(#T, sizeof(T))
#define FIELD(T, f) printf(", \"%s\": %zu", #f, offsetof(T, f))
#define END() printf("}")

int main(void) {
  printf("{\"constants\": {\"SP_MAX_DIMS\": %d, \"SP_TICKET_MAX\": %d, "
         "\"SP_PLACEMENT_SHARD0\": %d, \"SP_PLACEMENT_REPLICATED\": %d, "
         "\"SP_PLACEMENT_PLAIN\": %d, \"SP_PLACEMENT_EXPERT\": %d, "
         "\"SP_PLACEMENT_AFFINE\": %d, \"SP_STORAGE_MEMFD\": %d, "
         "\"SP_STORAGE_CUDA\": %d, \"SP_STORAGE_CUDA_IPC\": %d, "
         "\"SP_STORAGE_CUDA_FD\": %d, \"SP_MAX_CONSUMERS\": %d, "
         "\"SP_TARGET_WHOLE\": %d, \"SP_TARGET_SHARD\": %d, "
         "\"SP_TARGET_PIECES\": %d},\n\"structs\": {",
         SP_MAX_DIMS, SP_TICKET_MAX, SP_PLACEMENT_SHARD0,
         SP_PLACEMENT_REPLICATED, SP_PLACEMENT_PLAIN, SP_PLACEMENT_EXPERT,
         SP_PLACEMENT_AFFINE, SP_STORAGE_MEMFD, SP_STORAGE_CUDA,
         SP_STORAGE_CUDA_IPC, SP_STORAGE_CUDA_FD, SP_MAX_CONSUMERS,
         SP_TARGET_WHOLE, SP_TARGET_SHARD, SP_TARGET_PIECES);

  BEGIN(sp_node_status);
  FIELD(sp_node_status, node);
  FIELD(sp_node_status, address);
  FIELD(sp_node_status, self);
  FIELD(sp_node_status, connected);
  FIELD(sp_node_status, bytes_sent);
  FIELD(sp_node_status, bytes_received);
  FIELD(sp_node_status, control_sent);
  FIELD(sp_node_status, control_received);
  END();

  BEGIN(sp_job_status);
  FIELD(sp_job_status, job_id);
  FIELD(sp_job_status, phase);
  FIELD(sp_job_status, error);
  FIELD(sp_job_status, world);
  FIELD(sp_job_status, joined);
  FIELD(sp_job_status, round);
  FIELD(sp_job_status, rounds);
  FIELD(sp_job_status, bytes_moved);
  FIELD(sp_job_status, bytes_total);
  FIELD(sp_job_status, rate_bps);
  FIELD(sp_job_status, plan_digest);
  FIELD(sp_job_status, node);
  FIELD(sp_job_status, nnodes);
  FIELD(sp_job_status, nodes);
  FIELD(sp_job_status, asked);
  FIELD(sp_job_status, export_id);
  FIELD(sp_job_status, bytes_prepared);
  FIELD(sp_job_status, bytes_to_prepare);
  FIELD(sp_job_status, bytes_written);
  FIELD(sp_job_status, bytes_to_write);
  FIELD(sp_job_status, plans_reused);
  FIELD(sp_job_status, nconsumers);
  FIELD(sp_job_status, consumers);
  FIELD(sp_job_status, pushes);
  FIELD(sp_job_status, push_plans);
  END();

  BEGIN(sp_consumer_status);
  FIELD(sp_consumer_status, index);
  FIELD(sp_consumer_status, state);
  FIELD(sp_consumer_status, node);
  FIELD(sp_consumer_status, device);
  FIELD(sp_consumer_status, bytes_received);
  END();

  BEGIN(sp_status_info);
  FIELD(sp_status_info, daemon_version);
  FIELD(sp_status_info, protocol_version);
  FIELD(sp_status_info, backends_built);
  FIELD(sp_status_info, backend_active);
  FIELD(sp_status_info, backend_reason);
  FIELD(sp_status_info, uptime_s);
  FIELD(sp_status_info, clients);
  FIELD(sp_status_info, pool_used);
  FIELD(sp_status_info, pool_capacity);
  FIELD(sp_status_info, njobs);
  FIELD(sp_status_info, jobs);
  FIELD(sp_status_info, peer_address);
  FIELD(sp_status_info, draining);
  FIELD(sp_status_info, loop_max_busy_us);
  END();

  BEGIN(sp_ticket);
  FIELD(sp_ticket, len);
  FIELD(sp_ticket, bytes);
  END();

  BEGIN(sp_storage_desc);
  FIELD(sp_storage_desc, id);
  FIELD(sp_storage_desc, fd);
  FIELD(sp_storage_desc, offset);
  FIELD(sp_storage_desc, length);
  FIELD(sp_storage_desc, addr);
  FIELD(sp_storage_desc, kind);
  FIELD(sp_storage_desc, handle);
  FIELD(sp_storage_desc, handle_len);
  FIELD(sp_storage_desc, device);
  END();

  BEGIN(sp_piece);
  FIELD(sp_piece, ndim);
  FIELD(sp_piece, shape);
  FIELD(sp_piece, src_offset);
  FIELD(sp_piece, src_stride);
  FIELD(sp_piece, dst_offset);
  FIELD(sp_piece, dst_stride);
  FIELD(sp_piece, nholders);
  FIELD(sp_piece, holders);
  END();

  BEGIN(sp_tensor_desc);
  FIELD(sp_tensor_desc, key);
  FIELD(sp_tensor_desc, storage);
  FIELD(sp_tensor_desc, dtype);
  FIELD(sp_tensor_desc, ndim);
  FIELD(sp_tensor_desc, shape);
  FIELD(sp_tensor_desc, stride);
  FIELD(sp_tensor_desc, offset);
  FIELD(sp_tensor_desc, placement);
  FIELD(sp_tensor_desc, global_ndim);
  FIELD(sp_tensor_desc, global_shape);
  FIELD(sp_tensor_desc, npieces);
  FIELD(sp_tensor_desc, pieces);
  END();

  BEGIN(sp_group);
  FIELD(sp_group, nkeys);
  FIELD(sp_group, keys);
  END();

  BEGIN(sp_progress);
  FIELD(sp_progress, phase);
  FIELD(sp_progress, round);
  FIELD(sp_progress, rounds);
  FIELD(sp_progress, bytes_moved);
  FIELD(sp_progress, bytes_total);
  FIELD(sp_progress, bytes_written);
  FIELD(sp_progress, bytes_to_write);
  END();

  BEGIN(sp_metadata);
  FIELD(sp_metadata, key);
  FIELD(sp_metadata, value);
  END();

  BEGIN(sp_save_opts);
  FIELD(sp_save_opts, max_shard_bytes);
  FIELD(sp_save_opts, nmetadata);
  FIELD(sp_save_opts, metadata);
  FIELD(sp_save_opts, overwrite);
  FIELD(sp_save_opts, export_opts);
  END();

  BEGIN(sp_save_result);
  FIELD(sp_save_result, files);
  FIELD(sp_save_result, total_files);
  FIELD(sp_save_result, bytes);
  FIELD(sp_save_result, total_bytes);
  FIELD(sp_save_result, seconds);
  FIELD(sp_save_result, wrote_index);
  END();

  BEGIN(sp_export_opts);
  FIELD(sp_export_opts, ngroups);
  FIELD(sp_export_opts, groups);
  FIELD(sp_export_opts, max_keys);
  FIELD(sp_export_opts, max_bytes);
  FIELD(sp_export_opts, timeout_ms);
  FIELD(sp_export_opts, progress);
  FIELD(sp_export_opts, progress_arg);
  END();

  BEGIN(sp_owned_tensor);
  FIELD(sp_owned_tensor, key);
  FIELD(sp_owned_tensor, dtype);
  FIELD(sp_owned_tensor, ndim);
  FIELD(sp_owned_tensor, shape);
  FIELD(sp_owned_tensor, stride);
  FIELD(sp_owned_tensor, data);
  FIELD(sp_owned_tensor, identity);
  FIELD(sp_owned_tensor, device);
  FIELD(sp_owned_tensor, device_index);
  END();

  BEGIN(sp_owned_set);
  FIELD(sp_owned_set, export_id);
  FIELD(sp_owned_set, ntensors);
  FIELD(sp_owned_set, tensors);
  END();

  BEGIN(sp_target_piece);
  FIELD(sp_target_piece, start);
  FIELD(sp_target_piece, shape);
  FIELD(sp_target_piece, storage);
  FIELD(sp_target_piece, stride);
  FIELD(sp_target_piece, offset);
  END();

  BEGIN(sp_target_desc);
  FIELD(sp_target_desc, key);
  FIELD(sp_target_desc, dtype);
  FIELD(sp_target_desc, ndim);
  FIELD(sp_target_desc, global_shape);
  FIELD(sp_target_desc, part);
  FIELD(sp_target_desc, storage);
  FIELD(sp_target_desc, shape);
  FIELD(sp_target_desc, stride);
  FIELD(sp_target_desc, offset);
  FIELD(sp_target_desc, dim);
  FIELD(sp_target_desc, npieces);
  FIELD(sp_target_desc, pieces);
  END();

  BEGIN(sp_push_opts);
  FIELD(sp_push_opts, max_keys);
  FIELD(sp_push_opts, max_bytes);
  FIELD(sp_push_opts, timeout_ms);
  END();

  BEGIN(sp_push_result);
  FIELD(sp_push_result, push_id);
  FIELD(sp_push_result, bytes);
  FIELD(sp_push_result, plan_reused);
  END();

  printf("\n}}\n");
  return 0;
}
