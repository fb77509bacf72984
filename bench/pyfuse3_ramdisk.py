"""The Python peer of bench/infiniswap_fuse_compare.py: a RAM-backed FUSE file server on
pyfuse3 (libfuse3 low-level API, trio), the same shape as the C server — one regular
file `disk` of SIZE bytes in the mount root, opened with direct I/O.  Not max_read=1M:
libfuse 3.14 refuses a max_read mount option unless the file system's init() sets the same
value, which pyfuse3 does not; requests are still up to 1 MiB (libfuse negotiates
max_pages from its 1 MiB max_write).  The benchmark sets max_background /
congestion_threshold for it through fusectl, as the C server sets them in init().

    python bench/pyfuse3_ramdisk.py MOUNTPOINT SIZE_BYTES

Prints "ready" once mounted; SIGTERM / SIGINT unmount and exit.
"""
from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

DISK_INO = 2


class RamDisk(pyfuse3.Operations):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.data = bytearray(size)
        self.view = memoryview(self.data)
        self.now_ns = time.time_ns()

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        if inode == pyfuse3.ROOT_INODE:
            e.st_mode, e.st_nlink = stat.S_IFDIR | 0o755, 2
        elif inode == DISK_INO:
            e.st_mode, e.st_nlink, e.st_size = stat.S_IFREG | 0o600, 1, self.size
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        e.st_ino = inode
        e.st_uid, e.st_gid = os.getuid(), os.getgid()
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = self.now_ns
        e.attr_timeout = e.entry_timeout = 3600
        e.st_blksize = 4096
        return e

    async def getattr(self, inode, ctx=None):
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode == pyfuse3.ROOT_INODE and name == b"disk":
            return self._attr(DISK_INO)
        raise pyfuse3.FUSEError(errno.ENOENT)

    async def setattr(self, inode, attr, fields, fh, ctx):
        if fields.update_size and attr.st_size != self.size:
            raise pyfuse3.FUSEError(errno.EPERM)
        return self._attr(inode)

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        if start_id == 0:
            pyfuse3.readdir_reply(token, b"disk", self._attr(DISK_INO), 1)

    async def open(self, inode, flags, ctx):
        if inode != DISK_INO:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return pyfuse3.FileInfo(fh=inode, direct_io=True, keep_cache=False)

    async def read(self, fh, off, size):
        return self.view[off:min(off + size, self.size)]

    async def write(self, fh, off, buf):
        n = max(0, min(len(buf), self.size - off))
        self.view[off:off + n] = buf[:n]
        return n

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        pass

    async def release(self, fh):
        pass

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = self.size // 4096
        s.f_namemax = 255
        return s


async def serve() -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pyfuse3.main)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            print("ready", flush=True)
            async for _ in signals:
                pyfuse3.terminate()
                break


def main() -> int:
    mountpoint, size = sys.argv[1], int(sys.argv[2])
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=pyfuse3-ramdisk", "subtype=pyfuse3"}
    pyfuse3.init(RamDisk(size), mountpoint, opts)
    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
