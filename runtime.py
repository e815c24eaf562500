"""The process a script runs in, set up for speed: the persistent XLA compilation cache,
and glibc malloc for XLA's CPU buffers (docs/performance.md says why, with its
measurements); and the bytes a compiled program needs on its device.

train.py, bench.py's training child and scaling.py's runner call both before their first
compile; chat.py turns on the cache only.
"""

import contextlib
import ctypes
import math
import os
import re
import sys

import jax

# glibc >= 2.35: malloc madvises its heap onto huge pages
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def use_compile_cache(path):
    """Keep every compiled program in a persistent cache at path ('' for none): a second
    run of the same shapes skips XLA's compiles."""
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def huge_pages_offered():
    """glibc 2.35+ (which reads the hugetlb tunable) on a kernel that offers transparent
    huge pages."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            glibc = os.confstr("CS_GNU_LIBC_VERSION").split()[1]  # "glibc 2.36"
            version = tuple(map(int, glibc.split(".")))
            # "always" or "madvise": huge pages on offer
            return version >= (2, 35) and "[never]" not in f.read()
    return False


def tune_malloc(restart=False):
    """glibc malloc set for XLA's CPU buffers. A step's temporaries are one large block
    that malloc would map afresh every step, for the kernel to fault back in a page at a
    time: on transparent huge pages (glibc's hugetlb tunable) a fault is 2 MiB, not
    4 KiB. Tunables are read when a process starts, so with restart (a script, before its
    work) the process starts over once, here, with the tunable set. Without huge pages
    malloc keeps one heap that never shrinks instead. Either way each compile's freed
    memory is given back."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune
        return
    huge = huge_pages_offered()
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    # 1. huge pages: the script starts over with the tunable set (the same pid and argv)
    if huge and restart and HUGE_PAGES not in tunables:
        os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, (tunables, HUGE_PAGES)))
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    # 2. no huge pages: never mmap, never trim, one arena (no per-thread heaps)
    if not (huge and HUGE_PAGES in tunables):
        for option, value in ((-4, 0), (-1, -1), (-8, 1)):
            libc.mallopt(option, value)

    # 3. the compiler's freed memory handed back after each compile
    def trim(event, secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            libc.malloc_trim(0)
    jax.monitoring.register_event_duration_secs_listener(trim)


def needed_bytes(lowered, state_bytes):
    """The bytes a device needs for a lowered program once compiled: its arguments, the outputs
    that do not reuse them and its temporaries. When XLA refuses to compile it for lack of
    memory, its count of the temporaries plus state_bytes (the arguments), or infinity
    where it gives none."""
    try:
        m = lowered.compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        found = re.search(r"temporaries \(([\d.]+)G\)", str(e))
        return float(found.group(1)) * 2**30 + state_bytes if found else math.inf
    # a TPU's compiler simulates its heap: the peak is what is alive at once (its total of
    # temporaries counts buffers that never are: d20's step, 18.7 GiB by that count, ran
    # on the 15.75 GiB chip at a peak of 14.1). The CPU's peak counts no temporaries, and
    # a GPU's is unmeasured: there, arguments and temporaries as if all alive at once.
    if jax.default_backend() == "tpu" and getattr(m, "peak_memory_in_bytes", 0):
        return m.peak_memory_in_bytes
    arguments = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return arguments + m.temp_size_in_bytes
