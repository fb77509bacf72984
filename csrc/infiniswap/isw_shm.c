/*
 * isw_shm.c — same-host remote: the daemon's slab memfd mapped MAP_SHARED into this
 * process (opened through /proc/<daemon pid>/fd/<fd>).  READ/WRITE are memcpy at the
 * region offset; the daemon's CPU is not involved, as with one-sided RDMA.
 *
 * Owns: the memfd descriptor opened from the path and its mapping.
 *
 * The mapping keeps the daemon's memory alive even if the daemon dies; the daemon never
 * shrinks its memfd (it punches holes), so an access inside `size` never faults.
 */
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
};

static int shm_check(struct isw_remote *r, uint64_t off, size_t len)
{
    if (off > r->size || len > r->size - off)
        return isw_remote_error(r, 0, ERANGE,
                                "region [%llu, +%zu) is outside the %llu-byte shared memory",
                                (unsigned long long)off, len, (unsigned long long)r->size);
    return 0;
}

static int shm_read(struct isw_remote *r, uint64_t off, void *buf, size_t len)
{
    struct shm_remote *s = (struct shm_remote *)r;
    int rc = shm_check(r, off, len);
    if (rc == 0)
        memcpy(buf, s->mem + off, len);
    return rc;
}

static int shm_write(struct isw_remote *r, uint64_t off, const void *buf, size_t len)
{
    struct shm_remote *s = (struct shm_remote *)r;
    int rc = shm_check(r, off, len);
    if (rc == 0)
        memcpy(s->mem + off, buf, len);
    return rc;
}

static void shm_destroy(struct isw_remote *r)
{
    struct shm_remote *s = (struct shm_remote *)r;
    munmap(s->mem, r->size);
    close(s->fd);
    isw_remote_fini(r);
    free(s);
}

static const struct isw_remote_ops shm_ops = {
    .kind = "shm", .read = shm_read, .write = shm_write, .destroy = shm_destroy,
};

int isw_remote_shm_open(const char *path, uint64_t size, struct isw_remote **out)
{
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
    if (size == 0)
        size = (uint64_t)st.st_size;
    if (size == 0 || (uint64_t)st.st_size < size) {
        close(fd);
        return isw_fail(EINVAL, "shared memory '%s' is %lld bytes, asked to map %llu", path,
                        (long long)st.st_size, (unsigned long long)size);
    }
    void *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mem == MAP_FAILED) {
        rc = -errno;
        close(fd);
        return isw_fail(-rc, "cannot mmap %llu bytes of '%s': %s", (unsigned long long)size,
                        path, isw_strerror(rc));
    }
    struct shm_remote *s = calloc(1, sizeof *s);
    if (s == NULL) {
        munmap(mem, size);
        close(fd);
        return isw_fail(ENOMEM, "out of memory");
    }
    snprintf(desc, sizeof desc, "shm:%s", path);
    isw_remote_init(&s->base, &shm_ops, size, desc);
    s->fd = fd;
    s->mem = mem;
    *out = &s->base;
    return 0;
}
