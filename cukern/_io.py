"""Arrays on disk for the command line: opening ``.npy`` files and ``.npz`` members without
reading them into memory, and writing outputs that appear only when complete.

Inputs are memory-mapped read-only (an ``.npz`` member too when it is stored uncompressed, as
``np.savez`` writes it, after its size and CRC-32 are checked; a compressed member is
decompressed into memory in chunks, after its header is checked against its size). NumPy saves
``ml_dtypes.bfloat16`` arrays as raw 2-byte records (``'<V2'``); those are read as bfloat16.

Outputs go to a hidden temporary file beside the target (``.OUT.npy.XXXX.part``), with the disk
space reserved up front, and are renamed into place by :meth:`Outputs.commit`; until then the
target is untouched, and :meth:`Outputs.discard` (or leaving the ``with`` block on an error)
removes every temporary file. :func:`check_outputs` mentions ``.part`` files it finds that a
killed run left behind.
"""

from __future__ import annotations

import errno
import glob
import math
import os
import secrets
import shutil
import stat
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

__all__ = ["InputError", "RunError", "open_array", "float_dtype", "data_dtype", "np_dtype",
           "Outputs", "check_outputs"]

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_CHUNK = 1 << 24  # bytes read at a time when checking or decompressing an .npz member
FLOAT_NAMES = "float16, bfloat16, float32 or float64"
DATA_NAMES = ("bool, int8..int64, uint8..uint64, float16, bfloat16, float32, float64, complex64 "
              "or complex128")


class InputError(Exception):
    """The user's files or arguments are wrong (the command exits with status 2)."""


class RunError(Exception):
    """The machine cannot do it: no GPU, no disk space, out of memory (exit status 1)."""


def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a cukern dtype name (``"bfloat16"`` is ``ml_dtypes.bfloat16``)."""
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


def float_dtype(dtype: np.dtype, what: str) -> np.dtype:
    """The native float dtype cukern computes in for data stored as ``dtype`` (raw ``V2``
    records are bfloat16), or InputError naming ``what``."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise InputError(f"{what} holds Python objects (dtype object); expected {FLOAT_NAMES}")
    if dtype.kind == "V" and dtype.names is None and dtype.itemsize == 2 and not dtype.shape:
        return np_dtype("bfloat16")
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8):
        return dtype.newbyteorder("=")
    if dtype == np_dtype("bfloat16"):
        return dtype
    raise InputError(f"{what} has dtype {dtype}; expected {FLOAT_NAMES}")


def data_dtype(dtype: np.dtype, what: str) -> np.dtype:
    """The native dtype of data stored as ``dtype`` for ops that only move bytes (permute): bool,
    integers, floats (raw ``V2`` records are bfloat16) and complex, or InputError naming
    ``what``."""
    dtype = np.dtype(dtype)
    if dtype.kind == "V" and dtype.names is None and dtype.itemsize == 2 and not dtype.shape:
        return np_dtype("bfloat16")
    if dtype == np_dtype("bfloat16"):
        return dtype
    sizes = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16)}
    if dtype.names is None and not dtype.shape and dtype.itemsize in sizes.get(dtype.kind, ()):
        return dtype.newbyteorder("=")
    kind = "Python objects (dtype object)" if dtype.hasobject else f"dtype {dtype}"
    raise InputError(f"{what} has {kind}; expected {DATA_NAMES}")


def split_spec(spec: str) -> tuple[Path, str | None]:
    """``PATH`` or ``PATH.npz:KEY`` -> (path, key). A name that exists as a file wins."""
    if os.path.exists(spec) or ":" not in spec:
        return Path(spec), None
    path, key = spec.rsplit(":", 1)
    return Path(path), key


def open_array(spec: str, what: str | None = None, *, any_dtype: bool = False) -> np.ndarray:
    """Open ``PATH.npy`` or ``PATH.npz[:KEY]`` read-only, memory-mapped where possible.

    The result has a float dtype (bfloat16 for raw 2-byte records); with ``any_dtype``, also
    bool, integer or complex (:func:`data_dtype`). Raises InputError with a one-line message for
    a missing file, a file that is neither .npy nor .npz, an unknown key, or a dtype that is not
    float16, bfloat16, float32 or float64 (or not one of ``data_dtype``'s).
    """
    check = data_dtype if any_dtype else float_dtype
    path, key = split_spec(spec)
    what = what or spec
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path} is a directory, not an .npy or .npz file")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from None
    if magic.startswith(_NPY_MAGIC):
        if key is not None:
            raise InputError(f"{path} is an .npy file; ':{key}' names an array in an .npz file")
        return _map_npy(path, 0, what, check)
    if magic[:4] in _ZIP_MAGIC:
        return _open_member(path, key, what, check)
    raise InputError(f"{path} is not an .npy or .npz file")


def _read_header(f, what: str):
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"format version {version[0]}.{version[1]}")
    except (ValueError, EOFError) as err:
        raise InputError(f"{what} is not a readable .npy array ({err})") from None
    shape = tuple(shape)
    if any(n < 0 for n in shape):
        raise InputError(f"{what} is not a readable .npy array (its header gives the negative "
                         f"shape {shape})")
    if dtype.itemsize * math.prod(shape) >= 2**63:
        raise InputError(f"{what} is not a readable .npy array (its header gives the shape "
                         f"{shape}, more data than any file can hold)")
    return shape, bool(fortran), dtype, f.tell()


def _map_npy(path: Path, start: int, what: str, check=float_dtype,
             end: int | None = None) -> np.ndarray:
    """Memory-map the .npy image that begins ``start`` bytes into ``path`` and ends at ``end``
    (the end of the file by default); ``check(stored, what)`` gives the dtype the data is read
    as (or refuses it)."""
    with open(path, "rb") as f:
        f.seek(start)
        shape, fortran, stored, header_end = _read_header(f, what)
    dtype = check(stored, what)
    count = math.prod(shape)
    need = header_end + count * stored.itemsize
    have = path.stat().st_size if end is None else end
    if have < need:
        raise InputError(f"{what} is truncated: its header promises {need - header_end} bytes "
                         f"of data, the file holds {max(have - header_end, 0)}")
    order = "F" if fortran else "C"
    if count == 0:
        return np.empty(shape, dtype, order=order)
    arr = np.memmap(path, dtype=stored, mode="r", offset=header_end, shape=shape, order=order)
    return _as_float(arr, stored, dtype)


def _as_float(arr: np.ndarray, stored: np.dtype, dtype: np.dtype) -> np.ndarray:
    """Raw 2-byte records become bfloat16 in place; other floats keep their stored byte order
    (NumPy converts when they are copied)."""
    return arr.view(dtype) if stored.kind == "V" else arr


def _open_member(path: Path, key: str | None, what: str, check=float_dtype) -> np.ndarray:
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise InputError(f"{path} is not an .npy or .npz file (a damaged zip archive)") from None
    with zf:
        members = {n[:-4]: info for info in zf.infolist()
                   if (n := info.filename).endswith(".npy")}
        names = ", ".join(sorted(members)) or "none"
        if key is None:
            if len(members) != 1:
                raise InputError(f"{path} holds {len(members)} arrays ({names}); name one as "
                                 f"{path}:KEY")
            key = next(iter(members))
        if key not in members:
            raise InputError(f"{path} has no array {key!r} (it holds: {names})")
        info = members[key]
        label = f"{path}:{key}"
        if info.compress_type == zipfile.ZIP_STORED:
            return _map_stored(path, info, label, check)
        return _read_compressed(zf, info, label, check)


def _map_stored(path: Path, info: zipfile.ZipInfo, what: str, check) -> np.ndarray:
    """Memory-map a stored member, bounded by its own size in the archive, after checking its
    CRC-32 (read in chunks: the member is never held in memory whole)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise InputError(f"{what} is damaged (its local zip header is missing)")
    start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + \
        int.from_bytes(local[28:30], "little")
    end = start + info.file_size
    if info.compress_size != info.file_size or end > path.stat().st_size:
        raise InputError(f"{what} is truncated: the archive lists {info.file_size} bytes for "
                         f"it, the file holds {max(path.stat().st_size - start, 0)}")
    arr = _map_npy(path, start, what, check, end)
    crc = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = info.file_size
        while left:
            block = f.read(min(left, _CHUNK))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            left -= len(block)
    if left or crc != info.CRC:
        raise InputError(f"{what} is damaged: its CRC-32 does not match the archive's")
    return arr


def _read_compressed(zf: zipfile.ZipFile, info: zipfile.ZipInfo, what: str,
                     check) -> np.ndarray:
    """Decompress a member into memory in chunks, after checking that the size its .npy header
    declares fits in the member's uncompressed size (zipfile checks the CRC at the end)."""
    with zf.open(info) as f:
        shape, fortran, stored, header_end = _read_header(f, what)
        dtype = check(stored, what)
        count = math.prod(shape)
        nbytes = count * stored.itemsize
        if header_end + nbytes > info.file_size:
            raise InputError(f"{what} is truncated: its header promises {nbytes} bytes of "
                             f"data, the member holds {max(info.file_size - header_end, 0)}")
        avail = _available_memory()
        if avail is not None and nbytes > avail // 2:
            raise RunError(f"{what} is compressed and too large ({_size(nbytes)}) to "
                           f"decompress in memory; save it with np.savez (uncompressed)")
        data = np.empty(count, stored)
        view = memoryview(data.view(np.uint8).reshape(-1))
        done = 0
        try:
            while done < nbytes:
                got = f.readinto(view[done:done + _CHUNK])
                if not got:
                    break
                done += got
            while f.read(_CHUNK):  # the rest, so that zipfile checks the CRC
                pass
        except (zipfile.BadZipFile, zlib.error, EOFError) as err:
            raise InputError(f"{what} is damaged ({err})") from None
    if done < nbytes:
        raise InputError(f"{what} is truncated: its header promises {nbytes} bytes of data, "
                         f"the member holds {done}")
    return _as_float(data.reshape(shape, order="F" if fortran else "C"), stored, dtype)


def c_order(a: np.ndarray, what: str) -> np.ndarray:
    """``a`` itself when C-contiguous (a memory map stays one); a Fortran-ordered file is read
    into memory in C order, or refused when that would not fit."""
    if a.flags.c_contiguous:
        return a
    avail = _available_memory()
    if avail is not None and a.nbytes > avail // 2:
        raise RunError(f"{what} is stored in Fortran order and too large ({_size(a.nbytes)}) to "
                       f"reorder in memory; re-save it in C order (np.save(path, "
                       f"np.ascontiguousarray(a)))")
    return np.ascontiguousarray(a)


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def check_outputs(targets: dict[str, tuple[Path, int]], inputs: list[Path], *,
                  overwrite: bool) -> None:
    """Refuse outputs that are inputs, existing files without ``overwrite``, directories or
    missing folders, and outputs the disk cannot hold. ``targets``: option -> (path, bytes)."""
    seen: dict[str, str] = {}
    for opt, (path, _) in targets.items():
        real = os.path.realpath(path)
        if real in seen:
            raise InputError(f"{opt} {path} is also given as {seen[real]}")
        seen[real] = opt
        for src in inputs:
            if real == os.path.realpath(src) or (path.exists() and _same(path, src)):
                raise InputError(f"{opt} {path} is an input file; cukern never writes over its "
                                 f"inputs")
        if path.is_dir():
            raise InputError(f"{opt} {path} is a directory")
        if not path.parent.is_dir():
            raise InputError(f"{opt} {path}: folder {path.parent} does not exist")
        if path.exists() and not overwrite:
            raise InputError(f"{opt} {path} exists; pass --overwrite to replace it")
        if not os.access(path.parent, os.W_OK):
            raise RunError(f"{opt} {path}: folder {path.parent} is not writable")
    for _, (path, _) in targets.items():
        _mention_stale_parts(path)
    need: dict[int, tuple[Path, int, list[str]]] = {}
    for path, nbytes in targets.values():
        dev = path.parent.stat().st_dev
        folder, total, names = need.get(dev, (path.parent, 0, []))
        need[dev] = (folder, total + nbytes, names + [str(path)])
    for folder, total, names in need.values():
        free = shutil.disk_usage(folder).free
        if total > free:
            raise RunError(f"not enough disk space for {', '.join(names)}: needs "
                           f"{_size(total)}, {folder} has {_size(free)} free")


def _mention_stale_parts(target: Path) -> None:
    """A note on stderr for each hidden ``.part`` file of ``target`` found beside it: one that
    a killed run (SIGKILL, power loss) could not remove."""
    for part in sorted(target.parent.glob(glob.escape(f".{target.name}.") + "*.part")):
        sys.stderr.write(f"Note: {part} is left from an earlier run that did not finish; "
                         f"remove it unless a cukern run is writing {target} now\n")


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def npy_bytes(shape, dtype) -> int:
    """Size of an .npy file holding an array of this shape and dtype (header included)."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + 128


class Outputs:
    """Output files that appear only when complete.

    ``npy`` and ``scratch`` give writable memory maps on hidden temporary files beside their
    targets; ``npz`` writes an archive to one; :meth:`commit` flushes, syncs and renames every
    output into place. Leaving a ``with Outputs()`` block without committing removes all of
    them, so a failed or interrupted run leaves no partial file.
    """

    def __init__(self):
        self._temps: list[Path] = []
        self._moves: list[tuple[Path, Path]] = []
        self._maps: list[np.memmap] = []
        self._committed = False

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, *exc) -> None:
        if not self._committed:
            self.discard()

    def _temp(self, target: Path) -> Path:
        # The name is registered before the file exists: a signal arriving between the two
        # (its handler raises here) leaves discard() a name to remove, never an unknown file.
        while True:
            tmp = target.parent / f".{target.name}.{secrets.token_hex(8)}.part"
            self._temps.append(tmp)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:  # another run's file: not ours to remove
                self._temps.remove(tmp)
                continue
            os.close(fd)
            break
        try:  # --overwrite keeps the replaced file's permissions
            mode = stat.S_IMODE(target.stat().st_mode)
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        return tmp

    def npy(self, target: Path, shape, dtype) -> np.ndarray:
        """A writable array that becomes ``target`` (an .npy file) on commit."""
        tmp = self._temp(target)
        self._moves.append((tmp, target))
        return self._map(tmp, target, shape, dtype)

    def scratch(self, near: Path, shape, dtype) -> np.ndarray:
        """A writable array on disk beside ``near``, removed when the run ends."""
        return self._map(self._temp(near), near, shape, dtype)

    def _map(self, tmp: Path, target: Path, shape, dtype) -> np.ndarray:
        shape = tuple(int(n) for n in shape)
        if int(np.prod(shape, dtype=np.int64)) == 0:
            arr = np.empty(shape, dtype)
            with open(tmp, "wb") as f:
                np.save(f, arr)
            return arr
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
        _reserve(tmp, target)
        self._maps.append(mm)
        return mm

    def npz(self, target: Path, arrays: dict[str, np.ndarray]) -> None:
        """Write ``arrays`` (memory maps included) as an uncompressed .npz that becomes
        ``target`` on commit."""
        tmp = self._temp(target)
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        self._moves.append((tmp, target))

    def commit(self) -> None:
        """Flush and sync every output, then rename each into place."""
        for mm in self._maps:
            mm.flush()
        self._maps.clear()
        folders = set()
        for tmp, _ in self._moves:
            _fsync(tmp)
        for tmp, target in self._moves:
            os.replace(tmp, target)
            self._temps.remove(tmp)
            folders.add(target.parent)
        for folder in folders:
            _fsync(folder)
        self._committed = True
        self.discard()  # scratch files

    def discard(self) -> None:
        """Remove every temporary file (outputs not committed, and scratch)."""
        self._maps.clear()
        for tmp in self._temps:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        self._temps.clear()
        self._moves.clear()


def _reserve(path: Path, target: Path) -> None:
    """Allocate the file's blocks now: writing through a memory map onto a full disk would kill
    the process with SIGBUS instead of raising."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RunError(f"not enough disk space for {target}: {_size(os.fstat(fd).st_size)} "
                           f"could not be reserved in {path.parent}") from None
        # EOPNOTSUPP, EINVAL and friends: the file system cannot reserve; carry on
    except AttributeError:  # pragma: no cover - no posix_fallocate on this platform
        pass
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
