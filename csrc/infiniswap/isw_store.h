/*
 * isw_store.h — the daemon's slab store: one memfd holding every slab the daemon lends
 * (thesis §2.5).  Slabs are allocated lazily (fallocate + optional mlock) and freed by
 * munlock + hole punching, so freed memory really returns to the OS.  Devices on the same
 * host map the memfd through /proc/<pid>/fd/<fd>; remote devices go through the data
 * server (isw_dataserver.h).
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
 * frees the slab again and is returned, e.g. -ENOMEM/-EPERM under RLIMIT_MEMLOCK). */
int isw_store_alloc_slab(struct isw_store *s, int lock, uint64_t *region_offset);
int isw_store_free_slab(struct isw_store *s, uint64_t region_offset);
uint64_t isw_store_allocated_bytes(struct isw_store *s);
uint64_t isw_store_locked_bytes(struct isw_store *s);
/* Bytes of memory the memfd really holds (from st_blocks). */
int isw_store_resident_bytes(struct isw_store *s, uint64_t *out);
/* Copy to/from a range that lies inside one allocated slab (diagnostics, tests). */
int isw_store_read(struct isw_store *s, uint64_t off, void *buf, uint64_t len);
int isw_store_write(struct isw_store *s, uint64_t off, const void *buf, uint64_t len);
/* cffi:end */

/* For the data server. */
int isw_store_check_region(struct isw_store *s, uint64_t off, uint64_t len);
unsigned char *isw_store_base(struct isw_store *s);
void isw_store_acquire(struct isw_store *s);
void isw_store_release(struct isw_store *s);

#endif
