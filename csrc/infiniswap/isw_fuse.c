/*
 * isw_fuse.c — FUSE file server of the device (see isw_fuse.h).
 *
 * Owns: the libfuse session and mount, the loop thread (it runs fuse_session_loop_mt,
 * which starts and retires the worker threads), the per-thread I/O buffers, the page
 * locks of read-modify-write, the counters, and stopping all of it.
 *
 * Inodes: 1 is the root directory, 2 is `disk`; nothing else exists.
 *
 * I/O buffers: ISW_FUSE_MAX_THREADS buffers of 1 MiB + 2 pages are mapped, pre-faulted
 * and (where permitted) mlocked at start, so a worker never allocates on the paging
 * path.  A worker takes one from the pool at its first request and keeps it (thread-
 * specific data); the key's destructor gives it back when libfuse retires the thread.
 * Should more threads than buffers ever run, the extra one allocates its own.
 *
 * Reads: the covering page-aligned range is read into the thread's buffer and the
 * requested bytes are replied from it (fuse_reply_buf copies them to the kernel).
 * Writes: page-aligned ones go to the device straight from the request buffer; a partial
 * first or last page is read, patched and written back under one of 64 page-striped
 * locks, so concurrent unaligned writes to different bytes of one page do not lose each
 * other's data.
 *
 * Stopping: detach the mount (umount2 MNT_DETACH as root, `fusermount3 -u -z` else).
 * With nothing else holding the file, the kernel then tears the connection down, every
 * worker's read of /dev/fuse fails with ENODEV, and libfuse's loop returns.  While
 * something still holds the file open (a loop device), the workers keep answering for a
 * grace period; then the connection is aborted through fusectl (/sys/fs/fuse/connections,
 * mounted privately for the moment if it is not mounted), which fails every request
 * still queued and ends the loop.  The session is only touched again (unmounted,
 * destroyed) after the loop thread has been joined.
 */
#define FUSE_USE_VERSION 312

#include "isw_fuse.h"
#include "isw_common.h"
#include "isw_device.h"

#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <limits.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define ROOT_INO FUSE_ROOT_ID
#define DISK_INO 2
#define DISK_NAME "disk"
#define BUF_SIZE ((size_t)ISW_FUSE_MAX_IO + 2 * ISW_PAGE_SIZE)
#define PAGE_MASK ((uint64_t)ISW_PAGE_SIZE - 1)
#define NLOCKS 64
#define ATTR_TIMEOUT 3600.0
#define IDLE_THREADS 10
#define STOP_GRACE_MS 3000          /* let in-flight requests finish before aborting */
#define ABORT_WAIT_MS 10000
#define FUSECTL_DIR "/sys/fs/fuse/connections"
#define FUSECTL_MAGIC 0x65735543

struct iobuf {
    struct iobuf *next;
    struct isw_fuse *owner;
    int pooled;                 /* from the preallocated pool (else malloc'd on demand) */
    unsigned char *data;        /* BUF_SIZE bytes */
};

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

    pthread_key_t key;
    int key_ok;
    pthread_mutex_t pool_mu;
    struct iobuf *pool;         /* free preallocated buffers */
    struct iobuf *all;          /* every preallocated buffer (array) */
    int nbufs;

    pthread_mutex_t page_locks[NLOCKS];

    pthread_mutex_t err_mu;
    char io_error[256];

    _Atomic uint64_t reads, writes, bytes_read, bytes_written, unaligned, flushes, errors;
};

/* ---------- libfuse log messages ---------- */

/* While this thread starts a session, libfuse's messages are collected here (and put
 * into the error message) instead of being printed. */
static _Thread_local int tl_capture;
static _Thread_local char tl_fuse_msg[256];
static pthread_once_t log_once = PTHREAD_ONCE_INIT;

static void log_func(enum fuse_log_level level, const char *fmt, va_list ap)
{
    char msg[256];

    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    if (tl_capture) {
        if (level <= FUSE_LOG_WARNING && tl_fuse_msg[0] == '\0')
            snprintf(tl_fuse_msg, sizeof tl_fuse_msg, "%s", msg);
        return;
    }
    if (level <= FUSE_LOG_ERR)
        fprintf(stderr, "infiniswap fuse: %s\n", msg);
}

static void install_log(void)
{
    fuse_set_log_func(log_func);
}

static const char *fuse_msg(void)
{
    return tl_fuse_msg[0] ? tl_fuse_msg : "no details from libfuse";
}

/* ---------- buffers ---------- */

static unsigned char *map_buffer(void)
{
    void *p = mmap(NULL, BUF_SIZE, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    (void)mlock(p, BUF_SIZE);   /* best effort: without CAP_IPC_LOCK it may fail */
    return p;
}

static void buffer_release(void *arg)
{
    struct iobuf *b = arg;
    struct isw_fuse *f = b->owner;

    if (b->pooled) {
        pthread_mutex_lock(&f->pool_mu);
        b->next = f->pool;
        f->pool = b;
        pthread_mutex_unlock(&f->pool_mu);
    } else {
        munmap(b->data, BUF_SIZE);
        free(b);
    }
}

/* The calling worker's buffer (NULL only if the pool is empty and allocation failed). */
static unsigned char *thread_buffer(struct isw_fuse *f)
{
    struct iobuf *b = pthread_getspecific(f->key);

    if (b != NULL)
        return b->data;
    pthread_mutex_lock(&f->pool_mu);
    b = f->pool;
    if (b != NULL)
        f->pool = b->next;
    pthread_mutex_unlock(&f->pool_mu);
    if (b == NULL) {
        b = calloc(1, sizeof *b);
        if (b == NULL)
            return NULL;
        b->owner = f;
        b->data = map_buffer();
        if (b->data == NULL) {
            free(b);
            return NULL;
        }
    }
    if (pthread_setspecific(f->key, b) != 0) {
        buffer_release(b);
        return NULL;
    }
    return b->data;
}

static int pool_create(struct isw_fuse *f)
{
    f->all = calloc(ISW_FUSE_MAX_THREADS, sizeof *f->all);
    if (f->all == NULL)
        return isw_fail(ENOMEM, "out of memory");
    for (int i = 0; i < ISW_FUSE_MAX_THREADS; i++) {
        struct iobuf *b = &f->all[i];
        b->data = map_buffer();
        if (b->data == NULL)
            return isw_fail(ENOMEM, "cannot map a %zu-byte I/O buffer: %s", BUF_SIZE,
                            strerror(errno));
        b->owner = f;
        b->pooled = 1;
        b->next = f->pool;
        f->pool = b;
        f->nbufs++;
    }
    return 0;
}

static void pool_destroy(struct isw_fuse *f)
{
    if (f->all == NULL)
        return;
    for (int i = 0; i < f->nbufs; i++)
        munmap(f->all[i].data, BUF_SIZE);
    free(f->all);
    f->all = NULL;
}

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
    unsigned char *buf = thread_buffer(f);
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
    unsigned char *buf = thread_buffer(f);
    pthread_mutex_t *lk = &f->page_locks[(pg >> ISW_PAGE_SHIFT) % NLOCKS];
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

static const struct fuse_lowlevel_ops ops = {
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

/* ---------- the loop thread ---------- */

static void *loop_main(void *arg)
{
    struct isw_fuse *f = arg;
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();

    if (cfg != NULL) {
        fuse_loop_cfg_set_clone_fd(cfg, 1);
        fuse_loop_cfg_set_idle_threads(cfg, IDLE_THREADS);
        fuse_loop_cfg_set_max_threads(cfg, ISW_FUSE_MAX_THREADS);
    }
    int rc = fuse_session_loop_mt(f->se, cfg);
    if (cfg != NULL)
        fuse_loop_cfg_destroy(cfg);
    pthread_mutex_lock(&f->mu);
    f->loop_done = 1;
    f->loop_rc = rc;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

/* Wait up to ms for the loop to end; 1 if it ended. */
static int wait_loop(struct isw_fuse *f, unsigned ms)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&f->mu);
    while (!f->loop_done)
        if (pthread_cond_timedwait(&f->cv, &f->mu, &ts) == ETIMEDOUT)
            break;
    int done = f->loop_done;
    pthread_mutex_unlock(&f->mu);
    return done;
}

/* ---------- mount helpers ---------- */

/* Detach the mount: lazily, so it works while the file is busy.  0, or -errno. */
static int detach_mount(const char *mnt)
{
    if (geteuid() == 0) {
        if (umount2(mnt, MNT_DETACH) == 0 || errno == EINVAL || errno == ENOENT)
            return 0;           /* EINVAL: not a mount point (any more) */
        return -errno;
    }
    char *argv[] = { "fusermount3", "-u", "-z", "-q", (char *)mnt, NULL };
    pid_t pid;
    int st, rc = posix_spawnp(&pid, "fusermount3", NULL, NULL, argv, environ);
    if (rc != 0)
        return -rc;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return -errno;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -EBUSY;
}

static int write_abort(const char *dir, uint64_t conn)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%llu/abort", dir, (unsigned long long)conn);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t n = write(fd, "1", 1);
    int rc = n == 1 ? 0 : -errno;
    close(fd);
    return rc;
}

/* Abort the FUSE connection: every queued and future request fails, every worker's read
 * returns ENODEV.  Uses fusectl, mounted on a private directory if it is not mounted. */
static int abort_connection(struct isw_fuse *f)
{
    struct statfs sfs;
    int rc;

    if (statfs(FUSECTL_DIR, &sfs) == 0 && (unsigned long)sfs.f_type == FUSECTL_MAGIC) {
        rc = write_abort(FUSECTL_DIR, f->conn_id);
        if (rc == -ENOENT)
            return 0;           /* the connection is gone already */
        if (rc < 0)
            return isw_fail(-rc, "cannot abort FUSE connection %llu via " FUSECTL_DIR ": %s",
                            (unsigned long long)f->conn_id, isw_strerror(rc));
        return 0;
    }
    char dir[] = "/tmp/infiniswap-fusectl-XXXXXX";
    if (mkdtemp(dir) == NULL)
        return isw_fail(errno, "cannot abort FUSE connection %llu: fusectl is not mounted "
                        "and no directory could be made for it: %s",
                        (unsigned long long)f->conn_id, strerror(errno));
    if (mount("fusectl", dir, "fusectl", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) {
        rc = -errno;
        rmdir(dir);
        return isw_fail(-rc, "cannot abort FUSE connection %llu: fusectl is not mounted at "
                        FUSECTL_DIR " and mounting it failed: %s (needs root)",
                        (unsigned long long)f->conn_id, isw_strerror(rc));
    }
    rc = write_abort(dir, f->conn_id);
    umount2(dir, MNT_DETACH);
    rmdir(dir);
    if (rc == -ENOENT)
        return 0;
    if (rc < 0)
        return isw_fail(-rc, "cannot abort FUSE connection %llu: %s",
                        (unsigned long long)f->conn_id, isw_strerror(rc));
    return 0;
}

/* ---------- lifecycle ---------- */

static void destroy(struct isw_fuse *f)
{
    if (f->key_ok)
        pthread_key_delete(f->key);
    pool_destroy(f);
    for (int i = 0; i < NLOCKS; i++)
        pthread_mutex_destroy(&f->page_locks[i]);
    pthread_mutex_destroy(&f->mu);
    pthread_mutex_destroy(&f->stop_mu);
    pthread_mutex_destroy(&f->pool_mu);
    pthread_mutex_destroy(&f->err_mu);
    pthread_cond_destroy(&f->cv);
    free(f->mountpoint);
    free(f);
}

static int check_fsname(const char *s)
{
    if (*s == '\0' || strlen(s) > 200)
        return isw_fail(EINVAL, "fsname must be 1..200 characters");
    for (const char *p = s; *p; p++)
        if (*p == ',' || *p == '\\' || *p <= ' ' || *p == 0x7f)
            return isw_fail(EINVAL, "fsname '%s' must not contain commas, backslashes, "
                            "spaces or control characters", s);
    return 0;
}

int isw_fuse_start(struct isw_device *d, const char *mountpoint, const char *fsname,
                   struct isw_fuse **out)
{
    struct stat st;
    char opts[512];
    int rc;

    if (d == NULL || mountpoint == NULL || out == NULL)
        return isw_fail(EINVAL, "device, mountpoint and out are required");
    if (fsname == NULL)
        fsname = "infiniswap";
    if ((rc = check_fsname(fsname)) < 0)
        return rc;
    if (stat(mountpoint, &st) < 0)
        return isw_fail(errno, "mount point '%s': %s", mountpoint, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return isw_fail(ENOTDIR, "mount point '%s' is not a directory", mountpoint);
    if (access("/dev/fuse", R_OK | W_OK) < 0)
        return isw_fail(errno == ENOENT ? ENODEV : errno, "/dev/fuse: %s (is the fuse "
                        "kernel module loaded, and may this user use it?)", strerror(errno));
    if (isw_device_size(d) == 0)
        return isw_fail(EINVAL, "the device has size 0");

    struct isw_fuse *f = calloc(1, sizeof *f);
    if (f == NULL)
        return isw_fail(ENOMEM, "out of memory");
    f->dev = d;
    f->size = isw_device_size(d);
    f->uid = getuid();
    f->gid = getgid();
    clock_gettime(CLOCK_REALTIME, &f->born);
    pthread_mutex_init(&f->mu, NULL);
    pthread_mutex_init(&f->stop_mu, NULL);
    pthread_mutex_init(&f->pool_mu, NULL);
    pthread_mutex_init(&f->err_mu, NULL);
    for (int i = 0; i < NLOCKS; i++)
        pthread_mutex_init(&f->page_locks[i], NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&f->cv, &ca);
    pthread_condattr_destroy(&ca);

    f->mountpoint = realpath(mountpoint, NULL);
    if (f->mountpoint == NULL) {
        rc = isw_fail(errno, "mount point '%s': %s", mountpoint, strerror(errno));
        destroy(f);
        return rc;
    }
    if ((rc = pthread_key_create(&f->key, buffer_release)) != 0) {
        rc = isw_fail(rc, "pthread_key_create: %s", strerror(rc));
        destroy(f);
        return rc;
    }
    f->key_ok = 1;
    if ((rc = pool_create(f)) < 0) {
        destroy(f);
        return rc;
    }

    snprintf(opts, sizeof opts, "max_read=%u,fsname=%s,subtype=infiniswap,default_permissions",
             ISW_FUSE_MAX_IO, fsname);
    char *argv[] = { "infiniswap", "-o", opts, NULL };
    struct fuse_args args = FUSE_ARGS_INIT(3, argv);

    pthread_once(&log_once, install_log);
    tl_capture = 1;
    tl_fuse_msg[0] = '\0';
    f->se = fuse_session_new(&args, &ops, sizeof ops, f);
    if (f->se == NULL) {
        tl_capture = 0;
        rc = isw_fail(EINVAL, "cannot create a FUSE session: %s", fuse_msg());
        destroy(f);
        return rc;
    }
    if (fuse_session_mount(f->se, f->mountpoint) != 0) {
        tl_capture = 0;
        rc = isw_fail(EPERM, "cannot mount FUSE at '%s': %s", f->mountpoint, fuse_msg());
        fuse_session_destroy(f->se);
        destroy(f);
        return rc;
    }
    tl_capture = 0;
    rc = isw_thread_start(&f->loop_th, loop_main, f);
    if (rc < 0) {
        rc = isw_fail(-rc, "cannot start the FUSE loop thread: %s", isw_strerror(rc));
        fuse_session_unmount(f->se);
        fuse_session_destroy(f->se);
        destroy(f);
        return rc;
    }
    f->loop_started = 1;

    /* The root answers once the kernel finished INIT with our workers: we are serving. */
    int err = stat(f->mountpoint, &st) < 0 ? errno : st.st_ino != ROOT_INO ? EIO : 0;
    if (err != 0) {
        char msg[300];
        snprintf(msg, sizeof msg, "the FUSE mount at '%s' does not answer: %s",
                 f->mountpoint, err == EIO ? "another file system is mounted there" : strerror(err));
        isw_fuse_free(f);
        return isw_fail(err, "%s", msg);
    }
    f->conn_id = ((uint64_t)major(st.st_dev) << 20) | minor(st.st_dev);
    *out = f;
    return 0;
}

int isw_fuse_stop(struct isw_fuse *f)
{
    int rc = 0;

    if (f == NULL)
        return 0;
    pthread_mutex_lock(&f->stop_mu);
    if (f->stopped)
        goto out;
    if (!f->detached) {
        rc = detach_mount(f->mountpoint);
        if (rc < 0) {
            rc = isw_fail(-rc, "cannot unmount '%s': %s", f->mountpoint, isw_strerror(rc));
            goto out;
        }
        f->detached = 1;
    }
    if (f->loop_started && !wait_loop(f, STOP_GRACE_MS)) {
        /* Still held open (a loop device?) and still serving: stop serving for good. */
        fuse_session_exit(f->se);
        rc = abort_connection(f);
        if (rc < 0)
            goto out;
        if (!wait_loop(f, ABORT_WAIT_MS)) {
            rc = isw_fail(EBUSY, "the FUSE threads of '%s' did not stop after the connection "
                          "was aborted", f->mountpoint);
            goto out;
        }
    }
    if (f->loop_started) {
        pthread_join(f->loop_th, NULL);
        f->loop_started = 0;
    }
    fuse_session_unmount(f->se);        /* closes the device fd; the mount is gone already */
    fuse_session_destroy(f->se);
    f->se = NULL;
    f->stopped = 1;
out:
    pthread_mutex_unlock(&f->stop_mu);
    return rc;
}

void isw_fuse_free(struct isw_fuse *f)
{
    if (f == NULL)
        return;
    if (isw_fuse_stop(f) < 0) {
        fprintf(stderr, "infiniswap fuse: %s; leaking the server's memory\n", isw_last_error());
        return;
    }
    destroy(f);
}

int isw_fuse_stats(struct isw_fuse *f, struct isw_fuse_stats *out)
{
    if (f == NULL || out == NULL)
        return isw_fail(EINVAL, "server and out are required");
    out->reads = atomic_load(&f->reads);
    out->writes = atomic_load(&f->writes);
    out->bytes_read = atomic_load(&f->bytes_read);
    out->bytes_written = atomic_load(&f->bytes_written);
    out->unaligned = atomic_load(&f->unaligned);
    out->flushes = atomic_load(&f->flushes);
    out->errors = atomic_load(&f->errors);
    out->conn_id = f->conn_id;
    return 0;
}

int isw_fuse_last_io_error(struct isw_fuse *f, char *out, size_t n)
{
    if (f == NULL || out == NULL || n == 0)
        return isw_fail(EINVAL, "server and a non-empty buffer are required");
    pthread_mutex_lock(&f->err_mu);
    snprintf(out, n, "%s", f->io_error);
    pthread_mutex_unlock(&f->err_mu);
    return (int)strlen(out);
}

const char *isw_fuse_mountpoint(struct isw_fuse *f)
{
    return f->mountpoint;
}
