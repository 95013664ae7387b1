#!/usr/bin/env python3
"""Checks that moving CUDA code between files changed no kernel: compiles nothing itself, but
compares the PTX of every kernel (.entry) in two sets of PTX files, keyed by the demangled name
without namespaces, with what only says where the code lives normalized (every symbol as its
demangled name without namespaces, so anonymous-namespace file hashes drop out; basic-block
label numbers). Identical PTX through the same ptxas
gives identical machine code, so a pure code move needs no GPU run to be shown harmless.

  nvcc -Isrc -DDEEPSERVE_HAVE_CUDA=1 -O3 -DNDEBUG -arch=sm_90a -std=c++20 -ptx old.cu -o old.ptx
  ... (the same for the new files)
  tools/compare_kernel_ptx.py old.ptx --after new_a.ptx new_b.ptx

Exit status 0 when both sides hold the same kernels with the same PTX, 1 otherwise.
"""
import argparse
import re
import subprocess
import sys


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return dict(zip(names, out))


def strip_namespaces(demangled):
    name = demangled.replace("(anonymous namespace)::", "")
    # Drop every qualifier: the kernel's identity is its name, template arguments and parameters.
    return re.sub(r"\b(?:\w+::)+(?=\w)", "", name)


def kernels(paths):
    bodies = {}
    for path in paths:
        text = open(path).read()
        for m in re.finditer(r"\.entry (\S+)\(.*?\n}\n", text, re.S):
            bodies[m.group(1)] = m.group(0)
    # Every symbol a body names (the kernel, its static shared arrays, extern shared memory)
    # as its demangled name without namespaces: moving code to another file or namespace
    # changes only those.
    # (A kernel's parameters are named <kernel>_param_<i>.)
    symbol = r"(_Z\w+?)(_param_\d+)?\b"
    symbols = sorted({m[0] for body in bodies.values() for m in re.findall(symbol, body)})
    names = demangle(symbols)
    out = {}
    for mangled, body in bodies.items():
        norm = re.sub(symbol, lambda m: strip_namespaces(names[m.group(1)]) + (m.group(2) or ""),
                      body)
        norm = re.sub(r"\$L__BB\d+_", "$L__BB_", norm)
        out[strip_namespaces(names[mangled])] = norm
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", nargs="+", help="PTX files of the old tree")
    ap.add_argument("--after", nargs="+", required=True, help="PTX files of the new tree")
    args = ap.parse_args()
    before, after = kernels(args.before), kernels(args.after)
    ok = True
    for key in sorted(set(before) | set(after)):
        if key not in after or key not in before:
            print(f"only {'before' if key in before else 'after'}: {key}")
            ok = False
        elif before[key] != after[key]:
            print(f"different: {key}")
            ok = False
        else:
            print(f"identical: {key} ({before[key].count(chr(10))} lines)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
