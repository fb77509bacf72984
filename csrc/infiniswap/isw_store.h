/*
 * isw_store.h — the daemon's slab store: one memfd holding every slab the daemon lends
 * (thesis §2.5).  Slabs are allocated lazily (fallocate + optional mlock) and freed by
 * munlock + hole punching, so freed memory really returns to the OS.  Devices on the same
 * host map the memfd through /proc/<pid>/fd/<fd>; remote devices go through the data
 * server (isw_dataserver.h).
 *
 * Fencing (isw_fence.h): every slab has a generation; a device accesses a slab only with
 * the generation its lease was given, and a revoke (or a free) bumps it, so a device that
 * was too slow to give a slab back can no longer read or write it once the revoke has
 * drained.  Allocation runs without the store mutex (fallocate and mlock of a large slab
 * take seconds), so other calls are never held up by it.
 */
#ifndef ISW_STORE_H
#define ISW_STORE_H

#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
struct isw_store;

int isw_store_open(uint64_t capacity, uint64_t slab_size, struct isw_store **out);
/* -EBUSY while a data server uses the store.  Idempotent. */
int isw_store_close(struct isw_store *s);
/* Close and free; if a data server still uses it, it is freed when that server is. */
void isw_store_free(struct isw_store *s);

int isw_store_fd(struct isw_store *s);
uint64_t isw_store_capacity(struct isw_store *s);
uint64_t isw_store_slab_size(struct isw_store *s);
/* Allocate one slab: its region offset in *region_offset.  lock != 0: mlock it (a failure
 * frees the slab again and is returned, e.g. -ENOMEM/-EPERM under RLIMIT_MEMLOCK).  The
 * slot is reserved under the store mutex; the memory is allocated without it.  The slab
 * gets a new generation. */
int isw_store_alloc_slab(struct isw_store *s, int lock, uint64_t *region_offset);
/* Revoke the slab (below), wait briefly for accesses in progress, then release its memory.
 * -EBUSY (the slab stays allocated and revoked) if an access did not finish meanwhile. */
int isw_store_free_slab(struct isw_store *s, uint64_t region_offset);
/* Where this allocated slab lies in this process's mapping of the store (what the daemon
 * registers with an RDMA device when it lends the slab, isw_rdma.h). */
int isw_store_slab_address(struct isw_store *s, uint64_t region_offset, uint64_t *addr);
/* The generation a lease of this allocated slab gets (devices pass it on every access). */
int isw_store_slab_generation(struct isw_store *s, uint64_t region_offset, uint64_t *gen);
/* Take an allocated slab back: bump its generation, so no access with an older one
 * starts any more.  Returns 1 when no access is in progress either (the slab may be lent
 * again or freed), 0 while accesses that began before are still copying. */
int isw_store_revoke_slab(struct isw_store *s, uint64_t region_offset);
/* 1 when no access to the slab is in progress, 0 otherwise. */
int isw_store_slab_drained(struct isw_store *s, uint64_t region_offset);
/* Forget the slab's access count: only for counts left by processes that died inside an
 * access (the daemon knows every process that could access the slab is gone). */
int isw_store_reset_slab_users(struct isw_store *s, uint64_t region_offset);
uint64_t isw_store_allocated_bytes(struct isw_store *s);
uint64_t isw_store_locked_bytes(struct isw_store *s);
/* Bytes of memory the memfd really holds (from st_blocks). */
int isw_store_resident_bytes(struct isw_store *s, uint64_t *out);
/* Copy to/from a range that lies inside one allocated slab (diagnostics, tests). */
int isw_store_read(struct isw_store *s, uint64_t off, void *buf, uint64_t len);
int isw_store_write(struct isw_store *s, uint64_t off, const void *buf, uint64_t len);
/* Test hook: n > 0: the next n allocations wait after reserving their slot and before
 * allocating memory, with the store mutex released, so a test can use the store meanwhile;
 * n == 0: let every waiting allocation go on.  (An allocation that reaches the hook while
 * n == 0 is set and then n > 0 again may pass unheld: set holds before allocations start.) */
int isw_store_debug_hold_allocations(struct isw_store *s, int n);
/* How many allocations are waiting in that hook now. */
int isw_store_debug_allocations_held(struct isw_store *s);
/* cffi:end */

/* For the data server. */
int isw_store_check_region(struct isw_store *s, uint64_t off, uint64_t len);
/* Copy between buf and [off, off + len) of a slab leased at generation `gen`, inside the
 * slab's fence window (write != 0: into the slab).  0, or -ERANGE / -EFAULT (not
 * allocated) / -ESTALE (taken back) with a message. */
int isw_store_access(struct isw_store *s, uint64_t off, uint64_t len, uint64_t gen, void *buf,
                     int write);
/* Run fn(slab memory at off, len, arg) inside the slab's fence window, as isw_store_access
 * does its memcpy: fn must only copy (a socket call with MSG_DONTWAIT at most), never wait.
 * Returns fn's result, or the errors of isw_store_access. */
int isw_store_access_with(struct isw_store *s, uint64_t off, uint64_t len, uint64_t gen,
                          int (*fn)(unsigned char *mem, uint64_t len, void *arg), void *arg);
void isw_store_acquire(struct isw_store *s);
void isw_store_release(struct isw_store *s);

#endif
