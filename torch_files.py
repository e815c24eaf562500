"""PyTorch's serialization format, read and written without torch.

- Reading (`read_torch_state_dict`, `read_torch_tensor`): a `torch.save` zip's data.pkl
  through a restricted unpickler that resolves only the globals tensors need
  (`TORCH_GLOBALS`), so a pickle naming anything else (os.system, ...) is refused before
  it can run; storages are raw little-endian fp32, bf16, ... (`STORAGES`), each tensor a
  bounds-checked strided copy.
- Writing (`write_torch_state_dict`): protocol-2 pickles emitted opcode by opcode
  (`torch_pickle`: pickle names no global it cannot import), zip members 64-byte aligned
  as torch aligns them for torch.load(mmap=True).
"""

import collections
import itertools
import math
import os
import pickle
import struct
import zipfile
import zlib

import jax.numpy as jnp
import numpy as np

# ------------------------------------------------------------------------------ reading


class Unpickler(pickle.Unpickler):
    """Resolves only the globals in `allowed`; anything else is refused before it can be
    called."""

    def __init__(self, file, path, allowed, storage=None):
        super().__init__(file)
        self.path = path
        self.allowed = allowed
        self.storage = storage

    def find_class(self, module, name):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(
                f"{self.path}: refusing to load {module}.{name}: nanochat's files hold "
                "only tensors, dicts and tokenizer state, so this one is corrupt or "
                "malicious")
        return self.allowed[module, name]

    def persistent_load(self, pid):
        # torch's ("storage", type, key, location, numel)
        is_storage = isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
        if self.storage is None or not is_storage:
            raise pickle.UnpicklingError(f"{self.path}: unexpected persistent id; not a "
                                         "torch checkpoint")
        return self.storage(*pid[1:])


def _rebuild_tensor(storage, offset, size, stride, *_):
    """torch._utils._rebuild_tensor_v2 for numpy: a copy of the strided view,
    bounds-checked."""
    # 1. one past the last element the view reads (an empty tensor reads none)
    end = offset
    if all(size):
        end = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
    if offset < 0 or min(stride, default=0) < 0 or end > storage.size:
        raise pickle.UnpicklingError("corrupt checkpoint: a tensor runs past its "
                                     "storage")
    # 2. the strided view (strides in bytes), copied
    strides = [s * storage.itemsize for s in stride]
    view = np.lib.stride_tricks.as_strided(storage[offset:], size, strides)
    return np.array(view)


STORAGE_TYPES = (("FloatStorage", np.float32),
                 ("BFloat16Storage", jnp.bfloat16),
                 ("HalfStorage", np.float16),
                 ("DoubleStorage", np.float64),
                 ("IntStorage", np.int32),
                 ("LongStorage", np.int64))
# torch's storage types and their little-endian dtypes
STORAGES = {name: np.dtype(dt).newbyteorder("<") for name, dt in STORAGE_TYPES}
TORCH_GLOBALS = {("collections", "OrderedDict"): collections.OrderedDict,
                 ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                 **{("torch", name): dtype for name, dtype in STORAGES.items()}}


def read_torch_state_dict(path):
    """A `torch.save`d state_dict (zip format) as {name: numpy array}, without torch and
    without running code; a damaged or foreign file is a ValueError naming it."""
    state_dict = _read_torch_file(path)
    tensors = isinstance(state_dict, dict) and all(isinstance(v, np.ndarray)
                                                   for v in state_dict.values())
    if not tensors:
        raise ValueError(f"{path}: not a state_dict of tensors")
    return dict(state_dict)


def read_torch_tensor(path):
    """One `torch.save`d tensor (tokenizer/token_bytes.pt) as numpy, as
    read_torch_state_dict."""
    a = _read_torch_file(path)
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{path}: not a single tensor")
    return a


def _read_torch_file(path):
    try:
        return _read_torch_zip(path)
    except (zipfile.BadZipFile, KeyError, EOFError, pickle.UnpicklingError,
            ValueError) as e:
        said = str(e)  # our own errors name the file already
        if not said.startswith(f"{path}: "):
            said = f"{path}: a damaged torch checkpoint ({type(e).__name__}: {said})"
        raise ValueError(said) from None


def _read_torch_zip(path):
    with zipfile.ZipFile(path) as z:
        # 1. the pickle, and the byte order of the storages beside it
        names = z.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise ValueError(f"{path}: not a torch zip checkpoint (no data.pkl); "
                             "re-save it with torch >= 1.6")
        prefix = pkl[:-len("data.pkl")]
        byteorder = prefix + "byteorder"
        if byteorder in names and z.read(byteorder) != b"little":
            raise ValueError(f"{path}: a big-endian checkpoint; convert it on a "
                             "little-endian machine")

        # 2. each storage the pickle names, read from its member, length-checked

        def storage(dtype, key, location, numel):
            if not isinstance(dtype, np.dtype):
                raise pickle.UnpicklingError(f"{path}: a storage of unknown type")
            raw = z.read(f"{prefix}data/{key}")
            if len(raw) < numel * dtype.itemsize:
                raise pickle.UnpicklingError(f"{path}: storage {key} is shorter than "
                                             f"its {numel} elements")
            return np.frombuffer(raw, dtype, count=numel)

        # 3. the restricted unpickling
        with z.open(pkl) as f:
            return Unpickler(f, path, TORCH_GLOBALS, storage).load()

# ------------------------------------------------------------------------------ writing


def _ops(x):
    """x as pickle opcodes: bytes as is, str, int (LONG1 from 2**31) or a tuple of
    these."""
    if isinstance(x, bytes):
        return x
    if isinstance(x, str):
        encoded = x.encode()
        return pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded
    if isinstance(x, tuple):
        return pickle.MARK + b"".join(_ops(item) for item in x) + pickle.TUPLE
    if x < 2**31:
        return pickle.BININT + struct.pack("<i", x)
    return pickle.LONG1 + b"\x08" + struct.pack("<q", x)


def torch_pickle(obj):
    """(data.pkl, arrays) of torch.save(obj), obj a dict name -> array or one array."""
    storage_types = {dt.name: name for name, dt in STORAGES.items()}
    # OrderedDict()
    ordered_dict = pickle.GLOBAL + b"collections\nOrderedDict\n"
    ordered_dict += pickle.EMPTY_TUPLE + pickle.REDUCE

    # _rebuild_tensor_v2(storage, 0, shape, strides, False, OrderedDict())
    def tensor(a, key):
        if a.dtype.name not in storage_types:
            raise ValueError(f"cannot write a {a.dtype} tensor; cast it to one of "
                             f"{list(storage_types)}")
        # the storage: a persistent id naming data/<key>
        storage_type = pickle.GLOBAL + f"torch\n{storage_types[a.dtype.name]}\n".encode()
        storage = _ops(("storage", storage_type, key, "cpu", a.size)) + pickle.BINPERSID
        # C order, in elements
        strides = tuple(math.prod(a.shape[i + 1:]) for i in range(a.ndim))
        rebuild = pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n"
        arguments = (storage, 0, a.shape, strides, pickle.NEWFALSE, ordered_dict)
        return rebuild + _ops(arguments) + pickle.REDUCE
    # a dict's items, in order, each tensor's storage numbered; or the one tensor
    if isinstance(obj, dict):
        arrays = [np.asarray(a) for a in obj.values()]
        items = [_ops(name) + tensor(a, str(i))
                 for i, (name, a) in enumerate(zip(obj, arrays))]
        body = ordered_dict + pickle.MARK + b"".join(items) + pickle.SETITEMS
    else:
        arrays = [np.asarray(obj)]
        body = tensor(arrays[0], "0")
    return pickle.PROTO + b"\x02" + body + pickle.STOP, arrays


def write_torch_state_dict(path, state_dict, archive=None):
    """torch.save(state_dict, path) without torch; members under archive/ (torch: path's
    stem)."""
    pkl, arrays = torch_pickle(state_dict)
    # 1. the members: the pickle and its format, the storages (made one at a time), an id
    head = [("data.pkl", pkl),
            (".format_version", b"1"),
            (".storage_alignment", b"64"),
            ("byteorder", b"little")]
    storages = ((f"data/{i}", a.astype(a.dtype.newbyteorder("<")).tobytes())
                for i, a in enumerate(arrays))
    # torch writes a random 20 digits and a CRC: any 40 do
    tail = [("version", b"3\n"),
            (".data/serialization_id", f"{zlib.crc32(pkl):040d}".encode())]
    archive = archive or os.path.splitext(os.path.basename(path))[0]
    # 2. each stored (no compression), its data 64-byte aligned
    with open(path, "wb") as f, zipfile.ZipFile(f, "w") as z:
        for name, raw in itertools.chain(head, storages, tail):
            info = zipfile.ZipInfo(f"{archive}/{name}")
            # torch's padding, extra field "FB" + length + "Z"s; zipfile adds a zip64
            # field past 2 GB
            zip64 = 20 if len(raw) * 1.05 > zipfile.ZIP64_LIMIT else 0
            header = 30 + len(info.filename) + 4 + zip64
            pad = -(f.tell() + header) % 64
            info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            z.writestr(info, raw)
