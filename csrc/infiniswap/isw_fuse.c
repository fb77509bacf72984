/*
 * isw_fuse.c — FUSE file server of the device: its lifecycle (see isw_fuse.h).
 *
 * Owns: the libfuse session and mount, the loop thread (it runs fuse_session_loop_mt,
 * which starts and retires the worker threads), the server's memory and locks, libfuse's
 * log messages, and stopping all of it.  The request handlers are in isw_fuse_ops.c, the
 * workers' I/O buffers in isw_bufpool.c, unmounting and aborting in isw_fuse_mount.c.
 *
 * I/O buffers: ISW_FUSE_MAX_THREADS buffers of 1 MiB + 2 pages are preallocated at start
 * (isw_bufpool), so a worker never allocates on the paging path.
 *
 * Stopping: detach the mount (umount2 MNT_DETACH as root, `fusermount3 -u -z` else).
 * With nothing else holding the file, the kernel then tears the connection down, every
 * worker's read of /dev/fuse fails with ENODEV, and libfuse's loop returns.  While
 * something still holds the file open (a loop device), the workers keep answering for a
 * grace period; then the connection is aborted through fusectl, which fails every request
 * still queued and ends the loop.  The session is only touched again (unmounted,
 * destroyed) after the loop thread has been joined.
 */
#include "isw_fuse_server.h"
#include "isw_bufpool.h"
#include "isw_device.h"
#include "isw_fuse_mount.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define IDLE_THREADS 10
#define STOP_GRACE_MS 3000          /* let in-flight requests finish before aborting */
#define ABORT_WAIT_MS 10000

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

/* ---------- lifecycle ---------- */

static void destroy(struct isw_fuse *f)
{
    isw_bufpool_destroy(f->bufs);
    for (int i = 0; i < ISW_FUSE_NLOCKS; i++)
        pthread_mutex_destroy(&f->page_locks[i]);
    pthread_mutex_destroy(&f->mu);
    pthread_mutex_destroy(&f->stop_mu);
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
    pthread_mutex_init(&f->err_mu, NULL);
    for (int i = 0; i < ISW_FUSE_NLOCKS; i++)
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
    if ((rc = isw_bufpool_create(ISW_FUSE_MAX_THREADS, ISW_FUSE_BUF_SIZE, &f->bufs)) < 0) {
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
    f->se = fuse_session_new(&args, &isw_fuse_lowlevel_ops, sizeof isw_fuse_lowlevel_ops,
                             f);
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
    int err = stat(f->mountpoint, &st) < 0 ? errno : st.st_ino != ISW_FUSE_ROOT_INO ? EIO : 0;
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
        rc = isw_fuse_detach_mount(f->mountpoint);
        if (rc < 0) {
            rc = isw_fail(-rc, "cannot unmount '%s': %s", f->mountpoint, isw_strerror(rc));
            goto out;
        }
        f->detached = 1;
    }
    if (f->loop_started && !wait_loop(f, STOP_GRACE_MS)) {
        /* Still held open (a loop device?) and still serving: stop serving for good. */
        fuse_session_exit(f->se);
        rc = isw_fuse_abort_connection(f->conn_id);
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
