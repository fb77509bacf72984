/*
 * isw_shm.c — same-host remote: the daemon's slab memfd mapped MAP_SHARED into this
 * process (opened through /proc/<daemon pid>/fd/<fd>).  READ/WRITE are memcpy at the
 * region offset; the daemon's CPU is not involved, as with one-sided RDMA.
 *
 * Owns: the memfd descriptor opened from the path and its mapping.
 *
 * The file is a slab store (isw_fence.h): its footer says where the slabs end and the
 * fence lines begin.  Every memcpy runs inside the slab's fence window, with the
 * generation of the device's lease, so a slab the daemon has taken back is never copied
 * to or from (-ESTALE), even if this device is too slow to learn about it in time.
 *
 * The mapping keeps the daemon's memory alive even if the daemon dies; the daemon never
 * shrinks its memfd (it punches holes), so an access inside `size` never faults.
 */
#include "isw_fence.h"
#include "isw_remote.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

struct shm_remote {
    struct isw_remote base;
    int fd;
    unsigned char *mem;
    uint64_t map_size;              /* the whole file */
    uint64_t nslots;
    struct isw_fence_line *lines;
};

/* The fence line of the slab holding [off, off + len) in *line: 0, or -ERANGE (recorded). */
static int shm_line(struct isw_remote *r, uint64_t off, size_t len, struct isw_fence_line **line)
{
    struct shm_remote *s = (struct shm_remote *)r;

    if (off > r->size || len > r->size - off)
        return isw_remote_error(r, 0, ERANGE,
                                "region [%llu, +%zu) is outside the %llu-byte shared memory",
                                (unsigned long long)off, len, (unsigned long long)r->size);
    uint64_t slot = off / r->slab_size;
    if (len == 0 || (off + len - 1) / r->slab_size != slot || slot >= s->nslots)
        return isw_remote_error(r, 0, ERANGE, "region [%llu, +%zu) crosses a slab boundary",
                                (unsigned long long)off, len);
    *line = &s->lines[slot];
    return 0;
}

static int shm_copy(struct isw_remote *r, uint64_t off, uint64_t gen, void *dst,
                    const void *src, size_t len, const char *what)
{
    struct isw_fence_line *l;
    int rc = shm_line(r, off, len, &l);

    if (rc < 0)
        return rc;
    if (isw_fence_enter(l, gen) < 0)
        return isw_remote_error(r, 0, ESTALE, "%s at region offset %llu refused: the daemon "
                                "took the slab back (generation %llu is no longer valid)",
                                what, (unsigned long long)off, (unsigned long long)gen);
    memcpy(dst, src, len);
    isw_fence_leave(l);
    return 0;
}

static int shm_read(struct isw_remote *r, uint64_t off, uint64_t gen, void *buf, size_t len)
{
    struct shm_remote *s = (struct shm_remote *)r;
    return shm_copy(r, off, gen, buf, s->mem + off, len, "READ");
}

static int shm_write(struct isw_remote *r, uint64_t off, uint64_t gen, const void *buf,
                     size_t len)
{
    struct shm_remote *s = (struct shm_remote *)r;
    return shm_copy(r, off, gen, s->mem + off, buf, len, "WRITE");
}

static void shm_destroy(struct isw_remote *r)
{
    struct shm_remote *s = (struct shm_remote *)r;
    munmap(s->mem, s->map_size);
    close(s->fd);
    isw_remote_fini(r);
    free(s);
}

static const struct isw_remote_ops shm_ops = {
    .kind = "shm", .read = shm_read, .write = shm_write, .destroy = shm_destroy,
};

/* Check the footer of a mapped store file of `file_size` bytes; 0 or -EINVAL. */
static int check_footer(const char *path, const unsigned char *mem, uint64_t file_size,
                        struct isw_fence_footer *out)
{
    if (file_size < ISW_FENCE_FOOTER_SIZE)
        return isw_fail(EINVAL, "shared memory '%s' is %llu bytes: not a slab store", path,
                        (unsigned long long)file_size);
    memcpy(out, mem + file_size - ISW_FENCE_FOOTER_SIZE, sizeof *out);
    if (out->magic != ISW_FENCE_MAGIC)
        return isw_fail(EINVAL, "shared memory '%s' is not an Infiniswap slab store (no fence "
                        "footer)", path);
    if (out->version != ISW_FENCE_VERSION)
        return isw_fail(EINVAL, "shared memory '%s' has fence version %u, this device "
                        "speaks %u", path, out->version, ISW_FENCE_VERSION);
    if (out->slab_size == 0 || out->nslots == 0 || out->capacity != out->slab_size * out->nslots
        || isw_fence_file_size(out->capacity, out->nslots) != file_size)
        return isw_fail(EINVAL, "shared memory '%s' has an inconsistent fence footer", path);
    return 0;
}

int isw_remote_shm_open(const char *path, uint64_t size, struct isw_remote **out)
{
    struct isw_fence_footer foot;
    struct stat st;
    char desc[160];
    int fd, rc;

    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        rc = -errno;
        return isw_fail(-rc, "cannot open shared memory '%s': %s", path, isw_strerror(rc));
    }
    if (fstat(fd, &st) < 0) {
        rc = -errno;
        close(fd);
        return isw_fail(-rc, "cannot stat shared memory '%s': %s", path, isw_strerror(rc));
    }
    uint64_t file_size = (uint64_t)st.st_size;
    if (file_size == 0) {
        close(fd);
        return isw_fail(EINVAL, "shared memory '%s' is empty", path);
    }
    void *mem = mmap(NULL, file_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mem == MAP_FAILED) {
        rc = -errno;
        close(fd);
        return isw_fail(-rc, "cannot mmap %llu bytes of '%s': %s",
                        (unsigned long long)file_size, path, isw_strerror(rc));
    }
    rc = check_footer(path, mem, file_size, &foot);
    if (rc == 0 && size > foot.capacity)
        rc = isw_fail(EINVAL, "shared memory '%s' holds %llu bytes of slabs, asked to map %llu",
                      path, (unsigned long long)foot.capacity, (unsigned long long)size);
    struct shm_remote *s = rc == 0 ? calloc(1, sizeof *s) : NULL;
    if (rc == 0 && s == NULL)
        rc = isw_fail(ENOMEM, "out of memory");
    if (rc < 0) {
        munmap(mem, file_size);
        close(fd);
        return rc;
    }
    snprintf(desc, sizeof desc, "shm:%s", path);
    isw_remote_init(&s->base, &shm_ops, size == 0 ? foot.capacity : size, foot.slab_size, desc);
    s->fd = fd;
    s->mem = mem;
    s->map_size = file_size;
    s->nslots = foot.nslots;
    s->lines = (struct isw_fence_line *)((unsigned char *)mem + foot.capacity);
    *out = &s->base;
    return 0;
}
