/*
 * isw_remote.h — the remote-memory backend interface of a device.
 *
 * A remote is one daemon's slab memory as seen from a device: read/write `len` bytes at a
 * region offset.  Two backends: shared memory (isw_shm.c: the daemon's memfd mapped here,
 * a memcpy is the one-sided RDMA READ/WRITE) and TCP (isw_tcp_client.c: requests to the
 * daemon's data server).  Backends are thread-safe; read/write return 0 or -errno and
 * record the message with isw_remote_error().  A transport failure marks the remote dead
 * (permanently: the device's control loop unmaps its slabs and removes it).
 *
 * Every access names the generation of the device's lease of that slab (isw_fence.h): the
 * shared-memory backend checks it in the store's fence line around its memcpy, the TCP
 * backend sends it and the data server checks it.  A slab the daemon took back answers
 * -ESTALE, which fails that slab only; the remote stays alive.
 */
#ifndef ISW_REMOTE_H
#define ISW_REMOTE_H

#include "isw_common.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

struct isw_remote;

struct isw_remote_ops {
    const char *kind;
    int (*read)(struct isw_remote *r, uint64_t off, uint64_t gen, void *buf, size_t len);
    int (*write)(struct isw_remote *r, uint64_t off, uint64_t gen, const void *buf, size_t len);
    void (*destroy)(struct isw_remote *r);
};

struct isw_remote {
    const struct isw_remote_ops *ops;
    int id;                      /* device-assigned id */
    int nslabs;                  /* device slabs mapped to it (device control lock) */
    uint64_t size;               /* addressable bytes; UINT64_MAX when unknown (TCP) */
    uint64_t slab_size;          /* the store's slab size; 0 when unknown (TCP) */
    atomic_int dead;
    _Atomic uint64_t errors;
    _Atomic uint64_t bytes_read;     /* page I/O that succeeded through this remote */
    _Atomic uint64_t bytes_written;
    pthread_mutex_t err_mu;
    char err[256];               /* last error message, under err_mu */
    char desc[160];              /* "shm:/proc/1/fd/5" or "tcp:host:port" */
    int rto_min_us;              /* TCP: its connections' retransmission-timeout floor (us);
                                    0: the kernel's, or not TCP */
};

void isw_remote_init(struct isw_remote *r, const struct isw_remote_ops *ops, uint64_t size,
                     uint64_t slab_size, const char *desc);
void isw_remote_fini(struct isw_remote *r);
/* Record an error of this remote (and, if mark_dead, mark it dead); returns -err. */
int isw_remote_error(struct isw_remote *r, int mark_dead, int err, const char *fmt, ...)
    ISW_PRINTF(4, 5);
void isw_remote_last_error(struct isw_remote *r, char *out, size_t n);

int isw_remote_shm_open(const char *path, uint64_t size, struct isw_remote **out);
/* Every connection proves the cluster key `key` and checks the server's proof
 * (isw_auth.h) before it is used; the key is not kept.  Each asks for a retransmission-
 * timeout floor of `rto_min_us` (0..ISW_RTO_MIN_MAX_US; 0: the kernel's). */
int isw_remote_tcp_open(const char *host, int port, int connections, int timeout_ms,
                        int rto_min_us, const unsigned char *key, size_t key_len,
                        struct isw_remote **out);

#endif
