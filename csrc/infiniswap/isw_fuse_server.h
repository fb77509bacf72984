/*
 * isw_fuse_server.h — the FUSE server's state, shared inside the FUSE front end only: its
 * lifecycle (isw_fuse.c) creates and stops it, its request handlers (isw_fuse_ops.c)
 * answer the kernel with it.  Not part of the public API (that is isw_fuse.h).
 *
 * Inodes: 1 is the root directory, 2 is `disk`; nothing else exists.
 */
#ifndef ISW_FUSE_SERVER_H
#define ISW_FUSE_SERVER_H

#define FUSE_USE_VERSION 312

#include "isw_common.h"
#include "isw_fuse.h"

#include <fuse_lowlevel.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#define ISW_FUSE_ROOT_INO FUSE_ROOT_ID
#define ISW_FUSE_DISK_INO 2
#define ISW_FUSE_DISK_NAME "disk"
/* A worker's I/O buffer: the largest request widened to whole pages on both ends. */
#define ISW_FUSE_BUF_SIZE ((size_t)ISW_FUSE_MAX_IO + 2 * ISW_PAGE_SIZE)
/* Page-striped locks of read-modify-write. */
#define ISW_FUSE_NLOCKS 64

struct isw_bufpool;

struct isw_fuse {
    struct isw_device *dev;
    uint64_t size;
    struct fuse_session *se;
    char *mountpoint;           /* absolute */
    uid_t uid;
    gid_t gid;
    struct timespec born;
    uint64_t conn_id;

    pthread_t loop_th;
    int loop_started;
    pthread_mutex_t mu;         /* loop_done, loop_rc */
    pthread_cond_t cv;
    int loop_done;
    int loop_rc;

    pthread_mutex_t stop_mu;    /* serializes stop() */
    int detached;               /* the mount was detached */
    int stopped;                /* loop joined, session destroyed */

    struct isw_bufpool *bufs;   /* the workers' I/O buffers (ISW_FUSE_BUF_SIZE bytes) */

    pthread_mutex_t page_locks[ISW_FUSE_NLOCKS];

    pthread_mutex_t err_mu;
    char io_error[256];

    _Atomic uint64_t reads, writes, bytes_read, bytes_written, unaligned, flushes, errors;
};

/* The request handlers (isw_fuse_ops.c); the session's userdata is the struct isw_fuse. */
extern const struct fuse_lowlevel_ops isw_fuse_lowlevel_ops;

#endif
