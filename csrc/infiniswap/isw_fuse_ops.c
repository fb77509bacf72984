/*
 * isw_fuse_ops.c — the FUSE server's request handlers (libfuse3 low-level operations):
 * lookup/getattr/setattr/opendir/readdir/open/statfs of the two inodes, and read, write,
 * flush and fsync of `disk`, answered from the device core.
 *
 * Owns: turning requests into device calls and replies, the request counters and the last
 * I/O error message (struct isw_fuse, isw_fuse_server.h).  Runs on libfuse's worker
 * threads only; never creates or stops anything.
 *
 * Reads: the covering page-aligned range is read into the thread's buffer (isw_bufpool)
 * and the requested bytes are replied from it (fuse_reply_buf copies them to the kernel).
 * Writes: page-aligned ones go to the device straight from the request buffer; a partial
 * first or last page is read, patched and written back under one of ISW_FUSE_NLOCKS
 * page-striped locks, so concurrent unaligned writes to different bytes of one page do
 * not lose each other's data.
 */
#include "isw_fuse_server.h"
#include "isw_bufpool.h"
#include "isw_device.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#define ROOT_INO ISW_FUSE_ROOT_INO
#define DISK_INO ISW_FUSE_DISK_INO
#define DISK_NAME ISW_FUSE_DISK_NAME
#define PAGE_MASK ((uint64_t)ISW_PAGE_SIZE - 1)
#define ATTR_TIMEOUT 3600.0

/* ---------- request helpers ---------- */

static struct isw_fuse *server(fuse_req_t req)
{
    return fuse_req_userdata(req);
}

/* Answer with an error, count it, and keep the core's message for diagnostics. */
static void reply_fail(struct isw_fuse *f, fuse_req_t req, int rc, const char *what)
{
    int err = rc < 0 ? -rc : rc;

    atomic_fetch_add(&f->errors, 1);
    pthread_mutex_lock(&f->err_mu);
    snprintf(f->io_error, sizeof f->io_error, "%s: %s", what,
             isw_last_error()[0] ? isw_last_error() : strerror(err));
    pthread_mutex_unlock(&f->err_mu);
    fuse_reply_err(req, err ? err : EIO);
}

static void fill_attr(struct isw_fuse *f, fuse_ino_t ino, struct stat *st)
{
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    st->st_uid = f->uid;
    st->st_gid = f->gid;
    st->st_atim = st->st_mtim = st->st_ctim = f->born;
    st->st_blksize = ISW_PAGE_SIZE;
    if (ino == ROOT_INO) {
        st->st_mode = S_IFDIR | 0755;
        st->st_nlink = 2;
    } else {
        st->st_mode = S_IFREG | 0600;
        st->st_nlink = 1;
        st->st_size = (off_t)f->size;
        st->st_blocks = (blkcnt_t)(f->size / 512);
    }
}

static int known(fuse_ino_t ino)
{
    return ino == ROOT_INO || ino == DISK_INO;
}

/* ---------- operations ---------- */

static void op_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    conn->max_background = 128;         /* the kernel default (12) throttles async DIO */
    conn->congestion_threshold = 96;
    conn->max_write = ISW_FUSE_MAX_IO;
    conn->max_read = ISW_FUSE_MAX_IO;      /* must equal the max_read mount option */
    conn->want &= ~(unsigned)(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE |
                              FUSE_CAP_SPLICE_MOVE | FUSE_CAP_WRITEBACK_CACHE);
    if (conn->capable & FUSE_CAP_ASYNC_DIO)
        conn->want |= FUSE_CAP_ASYNC_DIO;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct isw_fuse *f = server(req);
    struct fuse_entry_param e;

    if (parent != ROOT_INO) {
        fuse_reply_err(req, known(parent) ? ENOTDIR : ENOENT);
        return;
    }
    if (strcmp(name, DISK_NAME) != 0) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    memset(&e, 0, sizeof e);
    e.ino = DISK_INO;
    e.generation = 1;
    e.attr_timeout = ATTR_TIMEOUT;
    e.entry_timeout = ATTR_TIMEOUT;
    fill_attr(f, DISK_INO, &e.attr);
    fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;

    (void)fi;
    if (!known(ino)) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    fill_attr(server(req), ino, &st);
    fuse_reply_attr(req, &st, ATTR_TIMEOUT);
}

static void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set,
                       struct fuse_file_info *fi)
{
    struct isw_fuse *f = server(req);
    struct stat st;

    (void)fi;
    if (!known(ino)) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    if (to_set & FUSE_SET_ATTR_SIZE) {
        if (ino != DISK_INO) {
            fuse_reply_err(req, EISDIR);
            return;
        }
        if ((uint64_t)attr->st_size != f->size) {   /* the device has a fixed size */
            fuse_reply_err(req, EPERM);
            return;
        }
    }
    if (to_set & (FUSE_SET_ATTR_MODE | FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID)) {
        fuse_reply_err(req, EPERM);
        return;
    }
    /* Times (touch) are accepted and ignored. */
    fill_attr(f, ino, &st);
    fuse_reply_attr(req, &st, ATTR_TIMEOUT);
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (ino != ROOT_INO) {
        fuse_reply_err(req, known(ino) ? ENOTDIR : ENOENT);
        return;
    }
    fuse_reply_open(req, fi);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi)
{
    static const char *const names[] = { ".", "..", DISK_NAME };
    static const fuse_ino_t inos[] = { ROOT_INO, ROOT_INO, DISK_INO };
    char buf[512];
    size_t len = 0, room = size < sizeof buf ? size : sizeof buf;
    struct stat st;

    (void)fi;
    if (ino != ROOT_INO) {
        fuse_reply_err(req, known(ino) ? ENOTDIR : ENOENT);
        return;
    }
    memset(&st, 0, sizeof st);
    for (off_t i = off < 0 ? 0 : off; i < 3; i++) {
        st.st_ino = inos[i];
        st.st_mode = i < 2 ? S_IFDIR : S_IFREG;
        size_t need = fuse_add_direntry(req, NULL, 0, names[i], NULL, 0);
        if (len + need > room)
            break;
        fuse_add_direntry(req, buf + len, room - len, names[i], &st, i + 1);
        len += need;
    }
    fuse_reply_buf(req, buf, len);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (ino != DISK_INO) {
        fuse_reply_err(req, ino == ROOT_INO ? EISDIR : ENOENT);
        return;
    }
    if (fi->flags & O_TRUNC) {  /* atomic_o_trunc: truncation comes here, not to setattr */
        fuse_reply_err(req, EPERM);
        return;
    }
    fi->direct_io = 1;          /* no page cache: every read/write reaches us */
    fi->keep_cache = 0;
    fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi)
{
    struct isw_fuse *f = server(req);
    (void)fi;

    if (ino != DISK_INO) {
        fuse_reply_err(req, EISDIR);
        return;
    }
    if (off < 0) {
        reply_fail(f, req, -EINVAL, "read");
        return;
    }
    uint64_t o = (uint64_t)off;
    if (o >= f->size || size == 0) {            /* end of file */
        atomic_fetch_add(&f->reads, 1);
        fuse_reply_buf(req, NULL, 0);
        return;
    }
    uint64_t n = size;
    if (n > ISW_FUSE_MAX_IO)
        n = ISW_FUSE_MAX_IO;                    /* a short read is fine with direct I/O */
    if (n > f->size - o)
        n = f->size - o;
    uint64_t a = o & ~PAGE_MASK, b = (o + n + PAGE_MASK) & ~PAGE_MASK;
    unsigned char *buf = isw_bufpool_thread_buffer(f->bufs);
    if (buf == NULL) {
        reply_fail(f, req, -ENOMEM, "read: no I/O buffer");
        return;
    }
    if (a != o || b != o + n)
        atomic_fetch_add(&f->unaligned, 1);
    int rc = isw_device_read(f->dev, a, buf, b - a);
    if (rc < 0) {
        reply_fail(f, req, rc, "read");
        return;
    }
    atomic_fetch_add(&f->reads, 1);
    atomic_fetch_add(&f->bytes_read, n);
    fuse_reply_buf(req, (const char *)buf + (o - a), n);
}

/* Patch bytes [pg + at, pg + at + n) of one page with src: read, modify, write back. */
static int rmw_page(struct isw_fuse *f, uint64_t pg, size_t at, const char *src, size_t n)
{
    unsigned char *buf = isw_bufpool_thread_buffer(f->bufs);
    pthread_mutex_t *lk = &f->page_locks[(pg >> ISW_PAGE_SHIFT) % ISW_FUSE_NLOCKS];
    int rc;

    if (buf == NULL)
        return isw_fail(ENOMEM, "no I/O buffer");
    pthread_mutex_lock(lk);
    rc = isw_device_read(f->dev, pg, buf, ISW_PAGE_SIZE);
    if (rc == 0) {
        memcpy(buf + at, src, n);
        rc = isw_device_write(f->dev, pg, buf, ISW_PAGE_SIZE);
    }
    pthread_mutex_unlock(lk);
    return rc;
}

static int write_unaligned(struct isw_fuse *f, uint64_t off, const char *src, uint64_t n)
{
    uint64_t end = off + n;
    int rc;

    if (off & PAGE_MASK) {                      /* partial first page */
        uint64_t pg = off & ~PAGE_MASK;
        uint64_t k = (end < pg + ISW_PAGE_SIZE ? end : pg + ISW_PAGE_SIZE) - off;
        if ((rc = rmw_page(f, pg, (size_t)(off - pg), src, (size_t)k)) < 0)
            return rc;
        off += k;
        src += k;
    }
    uint64_t mid_end = end & ~PAGE_MASK;
    if (off < mid_end) {                        /* whole pages */
        if ((rc = isw_device_write(f->dev, off, src, mid_end - off)) < 0)
            return rc;
        src += mid_end - off;
        off = mid_end;
    }
    if (off < end)                              /* partial last page */
        return rmw_page(f, off, 0, src, (size_t)(end - off));
    return 0;
}

static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi)
{
    struct isw_fuse *f = server(req);
    int rc;
    (void)fi;

    if (ino != DISK_INO) {
        fuse_reply_err(req, EISDIR);
        return;
    }
    if (off < 0) {
        reply_fail(f, req, -EINVAL, "write");
        return;
    }
    uint64_t o = (uint64_t)off, n = size;
    if (n == 0) {
        fuse_reply_write(req, 0);
        return;
    }
    if (o >= f->size) {                         /* the file cannot grow */
        reply_fail(f, req, -ENOSPC, "write past the end of the device");
        return;
    }
    if (n > f->size - o)
        n = f->size - o;                        /* short write up to the end */
    if ((o & PAGE_MASK) == 0 && (n & PAGE_MASK) == 0) {
        rc = isw_device_write(f->dev, o, buf, n);
    } else {
        atomic_fetch_add(&f->unaligned, 1);
        rc = write_unaligned(f, o, buf, n);
    }
    if (rc < 0) {
        reply_fail(f, req, rc, "write");
        return;
    }
    atomic_fetch_add(&f->writes, 1);
    atomic_fetch_add(&f->bytes_written, n);
    fuse_reply_write(req, (size_t)n);
}

static void do_flush(fuse_req_t req, fuse_ino_t ino)
{
    struct isw_fuse *f = server(req);

    if (ino != DISK_INO) {
        fuse_reply_err(req, 0);
        return;
    }
    int rc = isw_device_flush(f->dev);
    if (rc < 0) {
        reply_fail(f, req, rc, "flush");
        return;
    }
    atomic_fetch_add(&f->flushes, 1);
    fuse_reply_err(req, 0);
}

static void op_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    do_flush(req, ino);
}

static void op_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    (void)datasync;
    (void)fi;
    do_flush(req, ino);
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, 0);
}

static void op_statfs(fuse_req_t req, fuse_ino_t ino)
{
    struct isw_fuse *f = server(req);
    struct statvfs sv;

    (void)ino;
    memset(&sv, 0, sizeof sv);
    sv.f_bsize = ISW_PAGE_SIZE;
    sv.f_frsize = ISW_PAGE_SIZE;
    sv.f_blocks = f->size / ISW_PAGE_SIZE;
    sv.f_files = 2;
    sv.f_namemax = 255;
    fuse_reply_statfs(req, &sv);
}


const struct fuse_lowlevel_ops isw_fuse_lowlevel_ops = {
    .init = op_init,
    .lookup = op_lookup,
    .getattr = op_getattr,
    .setattr = op_setattr,
    .opendir = op_opendir,
    .readdir = op_readdir,
    .open = op_open,
    .read = op_read,
    .write = op_write,
    .flush = op_flush,
    .fsync = op_fsync,
    .release = op_release,
    .statfs = op_statfs,
    /* everything else: libfuse answers ENOSYS */
};
