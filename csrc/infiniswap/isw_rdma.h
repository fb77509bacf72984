/*
 * isw_rdma.h — RDMA for Infiniswap: a verbs device, its memory regions, RC queue pairs,
 * and a remote (isw_remote.h) whose READ/WRITE are one-sided RDMA operations.
 *
 * The daemon registers each slab it lends as its own memory region when it lends it, and
 * gives the device the slab's address and rkey (with its queue pair's address, below) in
 * the reply to MAP.  The rkey is the lease: taking the slab back deregisters the region
 * first, after which the device's NIC can no longer touch that memory — a hardware fence,
 * with no daemon CPU on the data path and no round trips of its own.  A device that was
 * too slow to give the slab back gets a remote access error, which breaks its queue pair:
 * that remote goes dead and its slabs fall back to disk (as with a failed daemon).  The
 * slab's memory may be freed (holes punched) only after its region was deregistered, so
 * pinned pages never go stale.
 *
 * Compiled into the core always; the verbs parts only when built with libibverbs
 * (ISW_HAVE_VERBS, set by infiniswap/_build_core.py where `pkg-config libibverbs` works).
 * Without them isw_rdma_open fails with a message saying so.  isw_rdma_debug_open_fake
 * gives a device on a *fake fabric*, with or without libibverbs: its keys come from a
 * counter and nothing is pinned, and its queue pairs (one process-wide table of them) do a
 * READ or WRITE as a memcpy after checking it as a NIC would: the peer queue pair must be
 * connected back to this one, the local buffer must lie in a region of this device with
 * that lkey, the remote range in a region of the peer's device with that rkey (writable for
 * a WRITE).  A failed check is a "remote access error" that puts the queue pair in the
 * error state, as on hardware.  So the registration table, the queue-pair exchange, the
 * remote and the fence (a deregistered slab's rkey stops working) are tested everywhere,
 * with a daemon and a device in one process.  Not run on hardware: this project's
 * machines have no RDMA device.
 */
#ifndef ISW_RDMA_H
#define ISW_RDMA_H

#include "isw_remote.h"

#include <stdint.h>

/* cffi:begin */
#define ISW_RDMA_GID_LEN 16

struct isw_rdma;
struct isw_rdma_qp;

/* What one side of an RC connection tells the other (over the control channel). */
struct isw_rdma_qp_info {
    uint32_t qpn;                     /* queue pair number (24 bits) */
    uint32_t psn;                     /* first packet sequence number (24 bits) */
    uint16_t lid;                     /* port LID (InfiniBand; 0 on RoCE) */
    uint8_t mtu;                      /* enum ibv_mtu of the port; the smaller one is used */
    uint8_t global;                   /* 1: route by GID (RoCE, or another subnet) */
    uint8_t gid[16];
};

/* 1 when this core was built with libibverbs. */
int isw_rdma_built(void);
/* RDMA devices ibv_get_device_list reports (0 when none, or not built with libibverbs). */
int isw_rdma_device_count(void);
/* Open a device (name NULL or "": the first one), its protection domain and port
 * (port 0: 1).  -ENODEV "no RDMA device found (ibv_get_device_list returned none): ..."
 * when there is none; -ENOTSUP when the core was built without libibverbs. */
int isw_rdma_open(const char *name, int port, int gid_index, struct isw_rdma **out);
/* Test hook: a device on the fake fabric (above): keys from a counter, nothing pinned,
 * queue pairs whose READ/WRITE are checked memcpys within this process. */
int isw_rdma_debug_open_fake(struct isw_rdma **out);
/* Deregister every region and close the device.  NULL is ignored.  Queue pairs still open
 * (a remote that was not removed yet) keep what they need until they are destroyed. */
void isw_rdma_close(struct isw_rdma *r);
const char *isw_rdma_device_name(struct isw_rdma *r);

/* Register [addr, addr + len) — or reuse a region that holds it (writable: one that local
 * writes and remote READ/WRITE may use).  Every call counts a reference; isw_rdma_dereg
 * with the same range drops it, the last one deregisters.  Keys in *lkey, *rkey. */
int isw_rdma_reg(struct isw_rdma *r, void *addr, uint64_t len, int writable, uint32_t *lkey,
                 uint32_t *rkey);
/* The keys of a region holding [addr, addr + len) (writable if asked): 0, or -ENOENT. */
int isw_rdma_lookup(struct isw_rdma *r, const void *addr, uint64_t len, int writable,
                    uint32_t *lkey, uint32_t *rkey);
/* Drop one reference of the region holding [addr, addr + len): 0, or -ENOENT. */
int isw_rdma_dereg(struct isw_rdma *r, const void *addr, uint64_t len);
/* Registered regions now. */
int isw_rdma_region_count(struct isw_rdma *r);

/* An RC queue pair with its completion queue; this side's address in *local.  The two
 * sides exchange their isw_rdma_qp_info over the control channel (RDMA_CONNECT /
 * RDMA_ACCEPT, infiniswap/protocol.py) and each connects its own queue pair. */
int isw_rdma_qp_create(struct isw_rdma *r, struct isw_rdma_qp **out, struct isw_rdma_qp_info *local);
/* RESET -> INIT -> RTR -> RTS towards the peer's queue pair. */
int isw_rdma_qp_connect(struct isw_rdma_qp *q, const struct isw_rdma_qp_info *remote);
void isw_rdma_qp_destroy(struct isw_rdma_qp *q);

/* On a real device: two queue pairs of this device connected to each other, a slab of
 * `slab_size` bytes registered and lent to an RDMA remote over one of them; WRITE a pattern
 * through the remote, check the slab, READ it back, then take the slab back (deregister)
 * and check that the next access fails and kills the remote.  0, or -errno with a message
 * saying which step failed. */
int isw_rdma_selftest(struct isw_rdma *r, uint64_t slab_size);

/* The device's side (implemented in isw_device.c, next to add_remote_shm/tcp). */
struct isw_device;
/* Add an RDMA remote of `nslots` slabs (of the device's slab size) over the connected queue
 * pair q, which it takes over: destroyed with the remote, or at once when this fails.
 * Returns the new remote id (>= 0). */
int isw_device_add_remote_rdma(struct isw_device *d, struct isw_rdma_qp *q, uint64_t nslots);
/* Before isw_device_map_slab of a slab on an RDMA remote: the daemon lent the slab at
 * `region_offset` at `generation`, registered at `addr` with `rkey` (its MR_INFO). */
int isw_device_set_rdma_slab(struct isw_device *d, int remote_id, uint64_t region_offset,
                             uint64_t generation, uint64_t addr, uint32_t rkey);
/* cffi:end */

/* A device's remote over RDMA: takes the connected queue pair (destroyed with the remote,
 * or at once when this fails).  Slabs are reached once isw_remote_rdma_set_slab said where;
 * a slot's lease is its generation together with the rkey the daemon registered for it. */
int isw_remote_rdma_open(struct isw_rdma_qp *q, uint64_t nslots, uint64_t slab_size,
                         struct isw_remote **out);
/* Lend slot `slot` at generation `gen`: the daemon's slab is at `addr` with `rkey`.
 * -EINVAL when r is not an RDMA remote, -ERANGE for a slot outside it. */
int isw_remote_rdma_set_slab(struct isw_remote *r, uint64_t slot, uint64_t gen, uint64_t addr,
                             uint32_t rkey);

#endif
