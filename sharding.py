"""Where the training state lives on a one-axis "data" mesh: train.py's --shard modes.

- none: parameters and optimizer state replicated on every device (plain data parallel).
- optimizer (ZeRO-2, arXiv 1910.02054): the optimizer state split over the devices and
  the gradients reduce-scattered to it; XLA gathers the updated parameters.
- full (FSDP): the parameters split too; XLA gathers each layer's weights where the
  forward and backward use them.
Each leaf splits on the first of its allowed axes that divides the device count
(`leaf_spec`); Muon's stacks split on the stack axis while it updates them, so each
device orthogonalizes whole matrices. Only the shardings of the step's inputs, outputs
and Muon's stacks are given: the collectives are the compiler's (GSPMD), and the model
and optimizer name no mesh axis. Several hosts join one mesh (`init_distributed`); the
gathers a checkpoint, a sample or an evaluation needs are here too. docs/scaling-out.md
tells the layout and the memory it takes.
"""

import json
import math

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MODES = ("none", "optimizer", "full")


def leaf_spec(shape, n, split_on):
    """A leaf's PartitionSpec over n devices on the "data" axis: the first axis, in the
    order split_on allows, that divides n. "stack": the leading one (Muon's stacks while
    it updates them); "matrix": a matrix's own two, then a stack's (full's params and
    gradients); "any": every one (the optimizer state). None keeps it whole, as does a
    leaf with no axis that divides."""
    dims = range(len(shape))
    allowed = {None: [],
               "stack": dims[:1],
               "matrix": [*dims[-2:], *dims[:-2]],
               "any": dims}
    # the first allowed axis that divides n: an equal share on every device
    for axis in allowed[split_on]:
        if n > 1 and shape[axis] % n == 0:
            return P(*[None] * axis, "data")
    return P()


def specs(tree, n, split_on):
    """leaf_spec of every leaf of tree (arrays or shapes), all split on the same axes."""
    return jax.tree.map(lambda a: leaf_spec(a.shape, n, split_on), tree)


def split_on(mode):
    """The axes (leaf_spec's split_on) of (params and gradients, optimizer state) under a
    --shard mode."""
    params_axes = "matrix" if mode == "full" else None
    state_axes = None if mode == "none" else "any"
    return params_axes, state_axes


def state_specs(params, opt_state, n, mode):
    """The PartitionSpecs of (params, opt_state), trees of arrays or shapes, under a
    mode."""
    params_axes, state_axes = split_on(mode)
    return specs(params, n, params_axes), specs(opt_state, n, state_axes)


def bytes_per_device(tree, tree_specs, n):
    """The bytes each of n devices holds of a tree (arrays or shapes) split as its
    tree_specs say."""
    leaves = jax.tree.leaves(tree)
    leaf_specs = jax.tree.leaves(tree_specs, is_leaf=is_spec)
    total = 0
    for leaf, spec in zip(leaves, leaf_specs):
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        # a split leaf leaves 1/n of its bytes on each device, a whole one all of them
        total += nbytes // (n if spec != P() else 1)
    return total


def is_spec(x):
    return isinstance(x, P)


def memory(params, opt_state, n, mode):
    """Bytes per device of the parameters, the gradients (sharded as the params) and the
    optimizer state."""
    params_specs, opt_specs = state_specs(params, opt_state, n, mode)
    params_bytes = bytes_per_device(params, params_specs, n)
    return {"params": params_bytes,
            "grads": params_bytes,
            "optimizer": bytes_per_device(opt_state, opt_specs, n)}


def constrain(tree, mesh, split_on):
    """Inside the jitted step: tree laid out on mesh, split on the axes split_on allows
    (specs'); nothing without a mesh."""
    if mesh is None:
        return tree

    # a constraint, not a transfer: the compiler (GSPMD) places the collectives
    def laid_out(leaf, spec):
        return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))
    return jax.tree.map(laid_out, tree, specs(tree, mesh.size, split_on))


def data_mesh():
    """Every device of every process on one "data" axis: the mesh training and
    evaluation use."""
    return Mesh(np.array(jax.devices()), ("data",))


def place(params, opt_state, mesh, mode):
    """(params, opt_state): host or device arrays put onto mesh, split as the mode (one
    of MODES, choose_mode's) says."""
    # each leaf's NamedSharding, then one transfer for the whole state
    both_specs = state_specs(params, opt_state, mesh.size, mode)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), both_specs,
                             is_leaf=is_spec)
    return jax.device_put((params, opt_state), shardings)


def choose_mode(mode, n, log=print):
    """The mode a run uses: optimizer by default on several devices (nanochat's), none
    on one."""
    if mode is None:
        return "optimizer" if n > 1 else "none"
    if mode not in MODES:
        raise ValueError(f"--shard {mode!r}: pass one of {', '.join(MODES)}")
    if mode != "none" and n == 1:
        log(f"warning: --shard {mode} needs several devices; this run has one, "
            "so --shard none")
        return "none"
    return mode


def describe(params, opt_state, n, mode):
    """The startup line's words on the mode and the bytes per device."""
    held = memory(params, opt_state, n, mode)
    mib = {part: f"{nbytes / 2**20:,.1f}" for part, nbytes in held.items()}
    return (f"--shard {mode}: per device {mib['params']} MiB params, "
            f"{mib['grads']} MiB grads, {mib['optimizer']} MiB optimizer state")


# -------------------------------------------------------------------- several processes


def init_distributed(coordinator=None, num_processes=None, process_id=None,
                     distributed=False):
    """Join the other processes of a multi-host run (a coordinator, or distributed:
    found by jax.distributed.initialize on TPU pods and under SLURM); alone, do
    nothing."""
    if coordinator or distributed:
        # the CPUs' collectives (other backends ignore it)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes, process_id)


def global_arrays(arrays, batch_sharding):
    """Global arrays laid out by batch_sharding, from each process's own rows of them
    (numpy)."""
    made = (jax.make_array_from_process_local_data(batch_sharding, a) for a in arrays)
    return tuple(made)


def to_host(x):
    """A device array as numpy in every process (a multi-host array is gathered
    first)."""
    if jax.process_count() > 1:
        return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def gather_tree(tree):
    """A tree of (possibly sharded) arrays whole on this host, as numpy: what a process
    writes. On several hosts a collective: every process calls it."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def local(params):
    """This process's own copy of the params (what sampling and generation run on): its
    replica, or the whole of sharded ones (train.py --shard full), gathered."""
    # replicated: the copy on this process's first device, no communication
    if all(leaf.is_fully_replicated for leaf in jax.tree.leaves(params)):
        return jax.tree.map(lambda leaf: leaf.addressable_data(0), params)
    # sharded: gathered whole (a collective), onto this process's first device
    return jax.device_put(gather_tree(params), jax.local_devices()[0])


def gather_states(states):
    """Every process's loader states, concatenated (a JSON round trip through
    process_allgather): what a multi-host run's checkpoint records."""
    if jax.process_count() == 1:
        return states
    # each process's states as JSON bytes, padded with spaces to the longest
    blob = np.frombuffer(json.dumps(states).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([blob.size]))
    longest = int(sizes.max())
    padded = np.pad(blob, (0, longest - blob.size), constant_values=ord(" "))
    # every process's row, each a JSON list of states
    rows = multihost_utils.process_allgather(padded)
    return [state for row in rows for state in json.loads(bytes(row).decode())]

# -------------------------------------------------------------------------------- flags


def add_flags(p):
    """train.py's flags of this file: the layout, and the processes of a multi-host
    run."""
    a = p.add_argument_group("scale out (docs/scaling-out.md)").add_argument
    a("--shard", default=None, choices=MODES,
      help="split the optimizer state, or it and the params (default: optimizer on >1 "
           "device)")
    a("--data-shards", type=int, default=0, help="document shards (0: one per process)")
    a("--coordinator", default=None,
      help="host:port of process 0, for multi-host jax.distributed")
    a("--num-processes", type=int, default=None,
      help="processes of a --coordinator run")
    a("--process-id", type=int, default=None,
      help="this process's rank, 0 to --num-processes - 1")
    a("--distributed", action="store_true",
      help="jax.distributed.initialize() on TPU pods, SLURM")
