/*
 * isw_fuse.h — the device's FUSE front end: one regular file, `disk`, in the root of a
 * FUSE mount, whose bytes are the bytes of an open isw_device (libfuse3 low-level API).
 *
 * Owns: the FUSE session, its mount, the thread that runs libfuse's multi-threaded loop,
 * the preallocated per-thread I/O buffers and the request counters.  It does not own the
 * device: the caller keeps it open until isw_fuse_stop() returned.  Implemented by
 * isw_fuse.c (lifecycle), isw_fuse_ops.c (request handlers), isw_fuse_mount.c (unmount,
 * connection abort) and isw_bufpool.c (I/O buffers).
 *
 * The file has the device's size and mode 0600; it cannot be truncated (setattr to
 * another size, open with O_TRUNC: EPERM), created or removed.  Reads and writes work
 * at any byte offset and length (the device core needs 4 KiB pages: unaligned requests
 * are widened or read-modify-written in the thread's buffer).  Files are opened with
 * direct I/O (no page cache), so `losetup --direct-io=on` gives a loop device whose I/O
 * reaches the device core with no copy in the kernel's page cache — the path for
 * `mkswap` / `swapon`.
 *
 * Settings measured to matter (DESIGN.md §4): max_background 128 with congestion
 * threshold 96, max_read / max_write 1 MiB, direct_io on open, no splice, clone_fd.
 *
 * Every function returns 0 or -errno, with a message in isw_last_error() (same thread).
 */
#ifndef ISW_FUSE_H
#define ISW_FUSE_H

#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
/* Largest read / write the kernel sends (max_read, max_write). */
#define ISW_FUSE_MAX_IO ((uint32_t)1 << 20)
/* The most threads libfuse runs, and the number of preallocated 1 MiB buffers. */
#define ISW_FUSE_MAX_THREADS 16

struct isw_device;
struct isw_fuse;

struct isw_fuse_stats {
    uint64_t reads, writes;             /* read / write requests answered */
    uint64_t bytes_read, bytes_written;
    uint64_t unaligned;                 /* requests not on 4 KiB pages (widened or RMW) */
    uint64_t flushes;                   /* flush + fsync */
    uint64_t errors;                    /* requests answered with an error */
    uint64_t conn_id;                   /* the kernel's FUSE connection (fusectl name) */
};

/* Mount a FUSE file system at `mountpoint` (an existing directory) serving `disk` from
 * `d`, and start serving.  `fsname` (NULL: "infiniswap") is the source shown in
 * /proc/mounts (no commas, spaces or backslashes).  Returns once the kernel finished
 * the FUSE handshake and the root answers, or fails with nothing left mounted. */
int isw_fuse_start(struct isw_device *d, const char *mountpoint, const char *fsname,
                   struct isw_fuse **out);
/* Detach the mount, let requests still in flight finish (at most a few seconds while
 * something — e.g. a loop device — still holds the file open), then abort the FUSE
 * connection if needed and join every thread.  Idempotent.  -EBUSY if the threads could
 * not be stopped (the connection could not be aborted); calling again retries. */
int isw_fuse_stop(struct isw_fuse *f);
/* Stop (if needed) and free.  If stop failed the server's memory is leaked on purpose:
 * threads may still use it. */
void isw_fuse_free(struct isw_fuse *f);
int isw_fuse_stats(struct isw_fuse *f, struct isw_fuse_stats *out);
/* The message of the last request that failed ("" if none); returns its length. */
int isw_fuse_last_io_error(struct isw_fuse *f, char *out, size_t n);
/* The absolute path of the mount point. */
const char *isw_fuse_mountpoint(struct isw_fuse *f);
/* cffi:end */

#endif
