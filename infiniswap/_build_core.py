"""cffi (API mode) builder of ``infiniswap._core``, the Infiniswap C core in ``csrc/infiniswap``.

Built by setuptools through ``setup.py`` (``cffi_modules``); running this file builds in place
(``setup.py build_ext --inplace``).  cffi API mode releases the GIL around every call, which
the blocking calls (page I/O, eviction drain, flush, server stop) rely on.

The FUSE front end (``isw_fuse.c``) links libfuse3: its compile and link flags come from
``pkg-config --cflags --libs fuse3``; without libfuse3's development files the build stops
with a message saying what to install.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_CSRC = "csrc/infiniswap"          # relative to the project root: setuptools wants relative paths
_SOURCES = [
    "isw_common.c",
    "isw_net.c",
    "isw_remote.c",
    "isw_shm.c",
    "isw_tcp_client.c",
    "isw_backup.c",
    "isw_device.c",
    "isw_store.c",
    "isw_dataserver.c",
    "isw_fuse.c",
]

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

CDEF = """
#define ISW_SLAB_UNMAPPED 0
#define ISW_SLAB_MAPPING 1
#define ISW_SLAB_MAPPED 2
#define ISW_SLAB_EVICTING 3
#define ISW_PAGE_SIZE ...
#define ISW_DEFAULT_PENDING_CAP ...
#define ISW_PROTO_MAGIC ...
#define ISW_PROTO_REPLY_MAGIC ...
#define ISW_PROTO_VERSION ...
#define ISW_PROTO_MAX_LEN ...

const char *isw_last_error(void);
const char *isw_strerror(int rc);

struct isw_device;
struct isw_slab_info {
    int state;
    int remote_id;
    uint64_t region_offset;
    uint64_t bits_set;
    int64_t in_flight;
    int failed;
    uint64_t pending_disk_writes;
    uint64_t bytes_read_remote;
    uint64_t bytes_written_remote;
    uint64_t bytes_read_disk;
    uint64_t bytes_written_disk;
};
struct isw_device_stats {
    uint64_t pages_read_remote, bytes_read_remote;
    uint64_t pages_read_disk, bytes_read_disk;
    uint64_t pages_written_remote, bytes_written_remote;
    uint64_t pages_written_disk_async, bytes_written_disk_async;
    uint64_t pages_written_disk_sync, bytes_written_disk_sync;
    uint64_t remote_errors;
    uint64_t disk_errors;
    uint64_t pending_disk_bytes, pending_disk_writes;
    uint64_t slabs_mapped;
};
int isw_device_open(uint64_t size, uint64_t slab_size, const char *backup_path,
                    int writer_threads, uint64_t pending_cap, struct isw_device **out);
int isw_device_close(struct isw_device *d);
void isw_device_free(struct isw_device *d);
uint64_t isw_device_size(struct isw_device *d);
uint64_t isw_device_slab_size(struct isw_device *d);
uint32_t isw_device_num_slabs(struct isw_device *d);
int isw_device_write(struct isw_device *d, uint64_t off, const void *buf, uint64_t len);
int isw_device_read(struct isw_device *d, uint64_t off, void *buf, uint64_t len);
int isw_device_flush(struct isw_device *d);
int isw_device_add_remote_shm(struct isw_device *d, const char *path, uint64_t size);
int isw_device_add_remote_tcp(struct isw_device *d, const char *host, int port,
                              int connections, int timeout_ms);
int isw_device_remove_remote(struct isw_device *d, int remote_id);
int isw_device_mark_remote_dead(struct isw_device *d, int remote_id);
int isw_device_remote_dead(struct isw_device *d, int remote_id);
int isw_device_remote_error(struct isw_device *d, int remote_id, char *out, size_t n);
int isw_device_begin_map(struct isw_device *d, uint32_t slab);
int isw_device_abort_map(struct isw_device *d, uint32_t slab);
int isw_device_map_slab(struct isw_device *d, uint32_t slab, int remote_id,
                        uint64_t region_offset);
int isw_device_begin_evict(struct isw_device *d, uint32_t slab);
int isw_device_unmap_remote(struct isw_device *d, int remote_id);
int isw_device_sample_activity(struct isw_device *d, uint64_t *out, uint32_t n);
int isw_device_failed_slabs(struct isw_device *d, uint32_t *out, uint32_t n);
int isw_device_slab_info(struct isw_device *d, uint32_t slab, struct isw_slab_info *out);
int isw_device_stats(struct isw_device *d, struct isw_device_stats *out);
int isw_device_set_debug_writer_delay(struct isw_device *d, uint32_t us);

struct isw_store;
int isw_store_open(uint64_t capacity, uint64_t slab_size, struct isw_store **out);
int isw_store_close(struct isw_store *s);
void isw_store_free(struct isw_store *s);
int isw_store_fd(struct isw_store *s);
uint64_t isw_store_capacity(struct isw_store *s);
uint64_t isw_store_slab_size(struct isw_store *s);
int isw_store_alloc_slab(struct isw_store *s, int lock, uint64_t *region_offset);
int isw_store_free_slab(struct isw_store *s, uint64_t region_offset);
uint64_t isw_store_allocated_bytes(struct isw_store *s);
uint64_t isw_store_locked_bytes(struct isw_store *s);
int isw_store_resident_bytes(struct isw_store *s, uint64_t *out);
int isw_store_read(struct isw_store *s, uint64_t off, void *buf, uint64_t len);
int isw_store_write(struct isw_store *s, uint64_t off, const void *buf, uint64_t len);

struct isw_server;
struct isw_server_stats {
    uint64_t connections;
    uint64_t active_connections;
    uint64_t requests;
    uint64_t read_requests, write_requests;
    uint64_t bytes_read;
    uint64_t bytes_written;
    uint64_t errors;
};
int isw_server_start(struct isw_store *store, const char *host, int port,
                     struct isw_server **out);
int isw_server_port(struct isw_server *srv);
int isw_server_stop(struct isw_server *srv);
void isw_server_free(struct isw_server *srv);
int isw_server_get_stats(struct isw_server *srv, struct isw_server_stats *out);

#define ISW_FUSE_MAX_IO ...
#define ISW_FUSE_MAX_THREADS ...
struct isw_fuse;
struct isw_fuse_stats {
    uint64_t reads, writes;
    uint64_t bytes_read, bytes_written;
    uint64_t unaligned;
    uint64_t flushes;
    uint64_t errors;
    uint64_t conn_id;
};
int isw_fuse_start(struct isw_device *d, const char *mountpoint, const char *fsname,
                   struct isw_fuse **out);
int isw_fuse_stop(struct isw_fuse *f);
void isw_fuse_free(struct isw_fuse *f);
int isw_fuse_stats(struct isw_fuse *f, struct isw_fuse_stats *out);
int isw_fuse_last_io_error(struct isw_fuse *f, char *out, size_t n);
const char *isw_fuse_mountpoint(struct isw_fuse *f);
"""

_FUSE_INC, _FUSE_CFLAGS, _FUSE_LIBS = _fuse3_flags()

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "infiniswap._core",
    """
#include "isw_common.h"
#include "isw_proto.h"
#include "isw_device.h"
#include "isw_store.h"
#include "isw_dataserver.h"
#include "isw_fuse.h"
""",
    sources=[f"{_CSRC}/{name}" for name in _SOURCES],
    include_dirs=[_CSRC, *_FUSE_INC],
    depends=[os.path.join(_CSRC, n) for n in sorted(os.listdir(os.path.join(_ROOT, _CSRC)))
             if n.endswith(".h")],
    extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE", "-pthread", "-Wall", "-Wextra",
                        *_FUSE_CFLAGS],
    extra_link_args=["-pthread", *_FUSE_LIBS],
)

if __name__ == "__main__":
    import sys

    subprocess.check_call([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=_ROOT)
