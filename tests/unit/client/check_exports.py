#!/usr/bin/env python3
"""Checks that a shared library exports exactly the SP_EXPORT functions of
the public header: usage: check_exports.py NM LIBRARY HEADER."""
import re
import subprocess
import sys


def header_exports(path):
    text = open(path, encoding="utf-8").read()
    # "SP_EXPORT const char *sp_strerror(int code);" -> sp_strerror; the
    # "#define SP_EXPORT ..." lines do not start with it.
    return set(re.findall(r"^\s*SP_EXPORT\b[^;(]*?\b(\w+)\s*\(", text,
                          re.M))


def library_exports(nm, path):
    out = subprocess.run([nm, "-D", "--defined-only", path], check=True,
                         capture_output=True, text=True).stdout
    names = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3:
            names.add(fields[2].split("@")[0])
    return names


def main():
    nm, lib, header = sys.argv[1:4]
    wanted = header_exports(header)
    have = library_exports(nm, lib)
    ok = True
    if not wanted:
        print(f"no SP_EXPORT declarations found in {header}")
        ok = False
    for name in sorted(have - wanted):
        print(f"exported but not SP_EXPORT in the header: {name}")
        ok = False
    for name in sorted(wanted - have):
        print(f"SP_EXPORT in the header but not exported: {name}")
        ok = False
    print(f"{len(have)} exported, {len(wanted)} declared: "
          + ("match" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
