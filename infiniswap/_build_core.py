"""cffi (API mode) builder of ``infiniswap._core``, the Infiniswap C core in ``csrc/infiniswap``.

Built by setuptools through ``setup.py`` (``cffi_modules``); running this file builds in place
(``setup.py build_ext --inplace``).  cffi API mode releases the GIL around every call, which
the blocking calls (page I/O, eviction drain, flush, server stop) rely on.

The FUSE front end (``isw_fuse.c``) links libfuse3: its compile and link flags come from
``pkg-config --cflags --libs fuse3``; without libfuse3's development files the build stops
with a message saying what to install.

The cdef is not written here: it is the public section of each header in ``_API_HEADERS``
(between ``/* cffi:begin */`` and ``/* cffi:end */``), so the C headers are the one source
of the declarations; ``#define``-d integer constants there are ``lib.<NAME>`` in Python.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_CSRC = "csrc/infiniswap"          # relative to the project root: setuptools wants relative paths
# Every C file of csrc/infiniswap is part of the core (`make sanitize` builds the same set).
_SOURCES = sorted(n for n in os.listdir(os.path.join(_ROOT, _CSRC)) if n.endswith(".c"))
# The headers whose public section (between /* cffi:begin */ and /* cffi:end */) is the cdef.
_API_HEADERS = (
    "isw_common.h",
    "isw_proto.h",
    "isw_device.h",
    "isw_store.h",
    "isw_dataserver.h",
    "isw_auth.h",
    "isw_fuse.h",
    "isw_rdma.h",
)

_FUSE_HELP = ("the Infiniswap C core needs libfuse3's development files (fuse3.pc, fuse_lowlevel.h) "
              "and pkg-config: install them, e.g. `apt-get install fuse3 libfuse3-dev pkg-config` "
              "(`make setup` does this when run as root)")


def _fuse3_flags() -> tuple[list[str], list[str], list[str]]:
    """(include dirs, extra compile args, link args) of libfuse3, from pkg-config."""
    if shutil.which("pkg-config") is None:
        raise SystemExit(f"pkg-config was not found: {_FUSE_HELP}")
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "fuse3"], check=True,
                                capture_output=True, text=True).stdout
        libs = subprocess.run(["pkg-config", "--libs", "fuse3"], check=True,
                              capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as exc:
        first = (exc.stderr.strip().splitlines() or ["no output"])[0]
        raise SystemExit(f"pkg-config does not know fuse3 ({first}): {_FUSE_HELP}") from None
    inc = [f[2:] for f in shlex.split(cflags) if f.startswith("-I")]
    other = [f for f in shlex.split(cflags) if not f.startswith("-I")]
    if not any(os.path.exists(os.path.join(d, "fuse_lowlevel.h")) for d in inc or ["/usr/include"]):
        raise SystemExit(f"fuse_lowlevel.h is missing: {_FUSE_HELP}")
    return inc, other, shlex.split(libs)


def _verbs_flags() -> tuple[list[str], list[str]]:
    """(compile args, link args) for the RDMA remote (isw_rdma.c) where libibverbs' development
    files are installed (``pkg-config libibverbs``); without them it is built as stubs."""
    if shutil.which("pkg-config") is None:
        return [], []
    found = subprocess.run(["pkg-config", "--cflags", "--libs", "libibverbs"], capture_output=True, text=True)
    if found.returncode != 0:
        return [], []
    flags = shlex.split(found.stdout)
    return ["-DISW_HAVE_VERBS", *(f for f in flags if not f.startswith("-l"))], [f for f in flags if f.startswith("-l")]


def _public_section(name: str, text: str) -> str:
    """The text between the header's ``/* cffi:begin */`` and ``/* cffi:end */`` markers."""
    sections = re.findall(r"/\*\s*cffi:begin\s*\*/(.*?)/\*\s*cffi:end\s*\*/", text, re.S)
    if not sections:
        raise SystemExit(f"{_CSRC}/{name} has no /* cffi:begin */ ... /* cffi:end */ section")
    return "\n".join(sections)


def _cdef_lines(section: str) -> list[str]:
    """The section as cffi declarations: comments dropped, every ``#define NAME value``
    turned into ``#define NAME ...`` (cffi takes the value from the compiler), every other
    preprocessor line dropped."""
    code = re.sub(r"/\*.*?\*/|//[^\n]*", " ", section, flags=re.S).replace("\\\n", " ")
    out = []
    for line in code.splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            if stripped:
                out.append(line.rstrip())
            continue
        define = re.match(r"#\s*define\s+([A-Za-z_]\w*)\s+\S", stripped)
        if define:
            out.append(f"#define {define.group(1)} ...")
    return out


def build_cdef(headers: Sequence[str] = _API_HEADERS) -> str:
    """The cdef of ``infiniswap._core``: the public sections of ``headers``, in order."""
    lines = []
    for name in headers:
        with open(os.path.join(_ROOT, _CSRC, name), encoding="utf-8") as fh:
            lines += _cdef_lines(_public_section(name, fh.read()))
    return "\n".join(lines) + "\n"


_FUSE_INC, _FUSE_CFLAGS, _FUSE_LIBS = _fuse3_flags()
_VERBS_CFLAGS, _VERBS_LIBS = _verbs_flags()

ffibuilder = FFI()
ffibuilder.cdef(build_cdef())
ffibuilder.set_source(
    "infiniswap._core",
    "".join(f'#include "{name}"\n' for name in _API_HEADERS),
    sources=[f"{_CSRC}/{name}" for name in _SOURCES],
    include_dirs=[_CSRC, *_FUSE_INC],
    depends=[os.path.join(_CSRC, n) for n in sorted(os.listdir(os.path.join(_ROOT, _CSRC)))
             if n.endswith(".h")],
    extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE", "-pthread", "-Wall", "-Wextra",
                        *_FUSE_CFLAGS, *_VERBS_CFLAGS],
    # libcrypto (OpenSSL): HMAC-SHA256, nonces and constant-time compares of isw_auth.c
    extra_link_args=["-pthread", *_FUSE_LIBS, *_VERBS_LIBS, "-lcrypto"],
)

if __name__ == "__main__":
    import sys

    subprocess.check_call([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=_ROOT)
