/*
 * isw_device.h — the Infiniswap block device core: slab table, page bitmap, counters and
 * the I/O router between remote memory and the backup file (thesis §2.4).
 *
 * Concurrency: any number of threads may call read/write at once (no global lock on the
 * I/O path: per-slab atomics, per-queue locks in isw_backup.c).  Control calls (map, evict,
 * remotes, info) serialize on one control mutex that the I/O path never takes.
 *
 * All functions return 0 / a non-negative value on success and -errno on failure, with a
 * message in isw_last_error() (same thread).
 */
#ifndef ISW_DEVICE_H
#define ISW_DEVICE_H

#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
#define ISW_SLAB_UNMAPPED 0
#define ISW_SLAB_MAPPING 1
#define ISW_SLAB_MAPPED 2
#define ISW_SLAB_EVICTING 3

#define ISW_DEFAULT_PENDING_CAP ((uint64_t)64 << 20)

struct isw_device;

struct isw_slab_info {
    int state;
    int remote_id;              /* -1 when unmapped */
    uint64_t region_offset;
    uint64_t generation;        /* of the daemon's lease (0 when unmapped) */
    uint64_t bits_set;          /* pages valid in remote memory */
    int64_t in_flight;
    int failed;                 /* a remote I/O of this slab failed since it was mapped */
    uint64_t pending_disk_writes;
    uint64_t bytes_read_remote;
    uint64_t bytes_written_remote;
    uint64_t bytes_read_disk;
    uint64_t bytes_written_disk;    /* synchronous + completed asynchronous */
};

struct isw_device_stats {
    uint64_t pages_read_remote, bytes_read_remote;
    uint64_t pages_read_disk, bytes_read_disk;
    uint64_t pages_written_remote, bytes_written_remote;
    uint64_t pages_written_disk_async, bytes_written_disk_async;
    uint64_t pages_written_disk_sync, bytes_written_disk_sync;
    uint64_t remote_errors;
    uint64_t disk_errors;           /* failed asynchronous disk writes */
    uint64_t pending_disk_bytes, pending_disk_writes;
    uint64_t slabs_mapped;
};

int isw_device_open(uint64_t size, uint64_t slab_size, const char *backup_path,
                    int writer_threads, uint64_t pending_cap, struct isw_device **out);
/* Flush, stop the writer threads, drop the remotes.  Later calls return -EBADF.  Waits for
 * calls in progress in other threads.  Idempotent. */
int isw_device_close(struct isw_device *d);
/* Close (if needed) and free the memory. */
void isw_device_free(struct isw_device *d);

uint64_t isw_device_size(struct isw_device *d);
uint64_t isw_device_slab_size(struct isw_device *d);
uint32_t isw_device_num_slabs(struct isw_device *d);

int isw_device_write(struct isw_device *d, uint64_t off, const void *buf, uint64_t len);
int isw_device_read(struct isw_device *d, uint64_t off, void *buf, uint64_t len);
int isw_device_flush(struct isw_device *d);

/* Remotes: returns the new remote id (>= 0). */
int isw_device_add_remote_shm(struct isw_device *d, const char *path, uint64_t size);
/* `key`: the cluster key every connection proves to the daemon's data server (not kept);
 * `rto_min_us`: the connections' retransmission-timeout floor asked for (0: the kernel's). */
int isw_device_add_remote_tcp(struct isw_device *d, const char *host, int port,
                              int connections, int timeout_ms, int rto_min_us,
                              const unsigned char *key, size_t key_len);
int isw_device_remove_remote(struct isw_device *d, int remote_id);
int isw_device_mark_remote_dead(struct isw_device *d, int remote_id);
/* 1 if dead, 0 if alive. */
int isw_device_remote_dead(struct isw_device *d, int remote_id);
int isw_device_remote_error(struct isw_device *d, int remote_id, char *out, size_t n);
/* The retransmission-timeout floor (us) a TCP remote's connections took; 0: the kernel's, or
 * not a TCP remote. */
int isw_device_remote_rto_min_us(struct isw_device *d, int remote_id);
/* Bytes read from and written to the remote's memory by page I/O that succeeded. */
int isw_device_remote_bytes(struct isw_device *d, int remote_id, uint64_t *bytes_read,
                            uint64_t *bytes_written);

/* Mapping control (thesis §2.4.2, §2.4.4). */
int isw_device_begin_map(struct isw_device *d, uint32_t slab);
int isw_device_abort_map(struct isw_device *d, uint32_t slab);
/* `generation`: of the daemon's lease of the region (isw_store_slab_generation); every
 * remote access passes it, and one the daemon's fence refuses fails the slab over to disk. */
int isw_device_map_slab(struct isw_device *d, uint32_t slab, int remote_id,
                        uint64_t region_offset, uint64_t generation);
/* EVICTING → drain in-flight remote I/O → bits cleared → UNMAPPED.  1 if it was mapped. */
int isw_device_begin_evict(struct isw_device *d, uint32_t slab);
/* begin_evict for every slab on the remote; returns how many. */
int isw_device_unmap_remote(struct isw_device *d, int remote_id);

/* Page I/Os per slab since the last sample (then reset); returns slabs filled. */
int isw_device_sample_activity(struct isw_device *d, uint64_t *out, uint32_t n);
/* Slabs whose remote I/O failed or whose remote is dead and which are not unmapped yet;
 * fills up to n, returns the total. */
int isw_device_failed_slabs(struct isw_device *d, uint32_t *out, uint32_t n);
int isw_device_slab_info(struct isw_device *d, uint32_t slab, struct isw_slab_info *out);
int isw_device_stats(struct isw_device *d, struct isw_device_stats *out);
/* Test hook: delay every background disk write by `us` microseconds. */
int isw_device_set_debug_writer_delay(struct isw_device *d, uint32_t us);
/* cffi:end */

#endif
