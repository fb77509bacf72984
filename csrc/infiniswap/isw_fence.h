/*
 * isw_fence.h — the fence of a slab store: one generation and one access count per slab,
 * shared by the daemon (its store and TCP data server) and every device that maps the
 * store's memory on the same host.
 *
 * Owns: the layout of the store's memfd and the access protocol on it.
 *
 * Layout of the memfd (every offset from the start of the file):
 *
 *     [0, capacity)                    the slabs (region offsets point here)
 *     [capacity, +nslots * 64)         one fence line per slab: generation, access count
 *     ...                              zero padding up to a page
 *     [file size - 64, file size)      the footer: magic, version, slab size, slots, capacity
 *
 * A device reads the footer of the file it maps to find the lines (isw_shm.c).
 *
 * Protocol (Dekker-style, seq_cst atomics on the shared lines; lock-free 64-bit atomics are
 * address-free, so it holds across processes):
 *   access (device, data server):  users++; if gen != mine { users--; -ESTALE }; copy; users--
 *   revoke (daemon):               gen++; drained when users == 0 afterwards
 * Either the accessor sees the new generation (and copies nothing) or the revoker sees its
 * increment (and waits).  So once a revoke has seen users == 0, no access with an older
 * generation is copying or can start: the slab may be freed or lent to someone else.
 */
#ifndef ISW_FENCE_H
#define ISW_FENCE_H

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>

#define ISW_FENCE_MAGIC 0x46575349u        /* "ISWF" */
#define ISW_FENCE_VERSION 1u
#define ISW_FENCE_LINE_SIZE 64u
#define ISW_FENCE_FOOTER_SIZE 64u

struct isw_fence_line {
    _Atomic uint64_t gen;           /* generation of the slab's current (or next) lease */
    _Atomic int64_t users;          /* accesses inside their copy window */
    unsigned char pad[ISW_FENCE_LINE_SIZE - 16];
};

struct isw_fence_footer {
    uint32_t magic, version;
    uint64_t slab_size;
    uint64_t capacity;              /* bytes of slabs; the lines start here */
    uint64_t nslots;
    unsigned char pad[ISW_FENCE_FOOTER_SIZE - 32];
};

_Static_assert(sizeof(struct isw_fence_line) == ISW_FENCE_LINE_SIZE, "fence line size");
_Static_assert(sizeof(struct isw_fence_footer) == ISW_FENCE_FOOTER_SIZE, "fence footer size");

/* Size of a store's memfd with `nslots` slabs in `capacity` bytes (a multiple of 4 KiB). */
static inline uint64_t isw_fence_file_size(uint64_t capacity, uint64_t nslots)
{
    uint64_t end = capacity + nslots * ISW_FENCE_LINE_SIZE + ISW_FENCE_FOOTER_SIZE;
    return (end + 4095u) & ~(uint64_t)4095u;
}

/* Enter the slab's copy window for generation `gen`: 0 (copy, then isw_fence_leave) or
 * -ESTALE (the slab was taken back; nothing to leave). */
static inline int isw_fence_enter(struct isw_fence_line *l, uint64_t gen)
{
    atomic_fetch_add(&l->users, 1);
    if (atomic_load(&l->gen) != gen) {
        atomic_fetch_sub(&l->users, 1);
        return -ESTALE;
    }
    return 0;
}

static inline void isw_fence_leave(struct isw_fence_line *l)
{
    atomic_fetch_sub(&l->users, 1);
}

#endif
