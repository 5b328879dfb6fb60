"""DistributedOptimizer: the Module API's way to average gradients over workers.

``Module`` has no trainer to subclass; it hands its gradients to an optimizer through an
``mx.optimizer.Updater``. Wrapping that optimizer is enough: each ``update`` first
averages the gradients over the workers, then lets the wrapped optimizer do its usual
update (as ``horovod.mxnet.DistributedOptimizer`` does). Everything else (learning rate
and scheduler, lr/wd multipliers, states, multi_precision) is the wrapped optimizer's.
On ``dist_async`` the servers run the wrapped optimizer instead: each ``update`` pushes
the gradient scaled by ``rescale_grad`` and pulls the weights
(:mod:`dist_gluon.async_updates`).
"""
from __future__ import annotations

import sys

import mxnet as mx
from mxnet.kvstore.base import KVStoreBase

from . import amp, async_updates
from . import join as _join
from . import timeline as _timeline
from .averaging import _GradientAverager, check_compression, check_predivide, claim_prefix
from .backends import Backend, resolve
from .devices import copy_from_first, sum_into_first

_MODULE_INIT_OPTIMIZER = mx.mod.Module.init_optimizer.__code__
# How far up the stack an installer (Module.init_optimizer, KVStore.set_optimizer) is
# looked for: pickling and mx.optimizer.get_updater put two or three frames in between.
_INSTALLER_DEPTH = 5
# What Module.init_optimizer passes to mx.optimizer.create for optimizer=<name>.
_MODULE_DEFAULTS = frozenset({"rescale_grad", "sym", "param_idx2name"})
_KVSTORE_HELP = (
    "DistributedOptimizer averages gradients over the workers itself, so MXNet must not "
    "use a kvstore as well (it would reduce the gradients a second time, or run the "
    "optimizer on the parameter servers). Pass kvstore=None: "
    "mod.fit(train_iter, kvstore=None, optimizer=opt) or "
    "mod.init_optimizer(kvstore=None, optimizer=opt)")


class DistributedOptimizer(mx.optimizer.Optimizer):
    """An optimizer that averages gradients over all workers before each update, for
    training with the Module API.

    Install it with ``kvstore=None``: ``mod.fit(train_iter, kvstore=None,
    optimizer=opt)`` or ``mod.init_optimizer(kvstore=None, optimizer=opt)``. Each
    ``update`` sums the gradients over the workers, then runs the wrapped optimizer.
    Every worker weighs in with ``1 / rescale_grad`` of its wrapped optimizer, i.e. its
    batch size (Module sets ``rescale_grad = 1 / batch_size``): the gradient the
    wrapped optimizer applies is the sum of every worker's gradients divided by the sum
    of their batch sizes (its ``rescale_grad`` is set to 1 for the update itself). So
    the workers train exactly like one process on the concatenation of their samples,
    also when their batch sizes differ (Modules bound with different batch sizes): N
    workers on B samples each are one process on N*B. The batch sizes travel with the
    first gradients of each step and the division runs on MXNet's engine, so no update
    waits for them in Python.

    Everything else is the wrapped optimizer's: reading or setting an attribute (``lr``,
    ``wd``, ``lr_scheduler``, ``rescale_grad``, ``idx2name``, ``param_dict``,
    ``multi_precision``, ``num_update``...) and calling ``set_learning_rate``,
    ``set_lr_mult``, ``set_wd_mult``, ``create_state`` or
    ``create_state_multi_precision`` reach it. Optimizer states are the wrapped
    optimizer's too, so ``mod.save_optimizer_states`` / ``load_optimizer_states`` and
    ``mod.save_checkpoint(..., save_optimizer_states=True)`` work as usual; the states
    are identical on every rank, so rank 0 alone can save them. A DistributedOptimizer
    can be pickled (MXNet does so when it saves an Updater with its optimizer); the copy
    finds its backend again when it is first used.

    Gradients are averaged by the same code as DistributedTrainer's, keyed by the
    optimizer's index of the parameter (its position in the Module's parameter list,
    the same on every rank), as ``'<prefix>.<index>'``.
    Aggregated updates (lists of indices, as MXNet's Updater passes them when
    ``MXNET_OPTIMIZER_AGGREGATION_SIZE`` > 0) are reduced in one call. On one process no
    collective is issued.

    Every rank must start from the same parameters: broadcast rank 0's with
    :func:`~dist_gluon.broadcast_parameters` before training (see the example).

    Parameters
    ----------
    optimizer : mx.optimizer.Optimizer or str
        The optimizer to wrap, or the name of one (``'sgd'``, ``'adam'``...) created
        with ``mx.optimizer.create(optimizer, **optimizer_params)``. Created from a
        name, it is set up by ``init_optimizer`` as Module sets up ``optimizer='sgd'``:
        ``rescale_grad = 1 / batch_size``, and the symbol's parameter names and
        ``lr_mult`` / ``wd_mult`` attributes (so biases get no weight decay), except
        what ``optimizer_params`` gives. An instance is used as it is, as Module does.
    kv : backend, backend name, or None
        None picks the backend from the environment (``dist_gluon.create()``).
    compression : None, 'fp16', '2bit', 'powersgd' or dict
        As in :class:`~dist_gluon.DistributedTrainer` (:mod:`dist_gluon.compression`).
        Module's updater passes tensors in groups; each group is compressed on its own.
    gradient_predivide_factor : float
        As in Horovod: gradients are divided by this factor before the sum and
        multiplied back after it, which keeps fp16 sums in range on many workers.
    prefix : str, optional
        Names this optimizer's communication keys. By default optimizers are numbered in
        construction order (which must be the same on every rank), so several models
        trained in one program never share keys; a prefix already used in this process
        is a ValueError.
    loss_scale : float or 'dynamic', default 1
        A float: the factor this rank's loss was multiplied by (static loss scaling),
        which its ``rescale_grad`` divides out: ``rescale_grad = 1 / (batch_size *
        loss_scale)``. Each rank's gradient is unscaled by its own ``loss_scale`` before
        the sum, and the rank is weighed by its batch size ``1 / (rescale_grad *
        loss_scale)``, so ranks whose scales differ still train like one process. Set
        ``opt.loss_scale`` whenever the scale changes.
        ``'dynamic'``: MXNet AMP's dynamic loss scaling, as ``amp.init_trainer`` gives a
        Gluon trainer. Multiply the loss's gradient by ``opt.loss_scale`` (2**16 at
        first), e.g. ``mod.backward(out_grads=[mx.nd.full(shape, opt.loss_scale)])``
        for a loss output, and leave ``rescale_grad = 1 / batch_size``: the optimizer
        divides the scale out. A step whose gradients hold an inf or a NaN on any rank
        is skipped on every rank (no gradient is sent, no codec state changes) and
        halves the scale; 2000 clean steps double it, as on one process. The check
        needs every gradient of the step at its first update, so the optimizer must be
        installed by a Module (``init_optimizer`` or ``fit`` with ``kvstore=None``);
        the verdict travels with the batch sizes (one scalar wait per step).
    **optimizer_params
        Arguments of ``mx.optimizer.create`` when ``optimizer`` is a name.

    Raises
    ------
    ValueError
        On every rank, when ``init_optimizer`` (or ``fit``) installs it with a kvstore
        other than None (a KVStore or backend object, a 'dist_*' name), when a
        ``KVStore.set_optimizer`` is given it (gluon's ``update_on_kvstore``), when the
        Module has several contexts on dist_async, or when ``optimizer`` is already a
        DistributedOptimizer. (``kvstore='local'``, fit's default, means no
        kvstore on one device and is accepted.) Note that Module creates the kvstore
        it is given a name of before it consults the optimizer: ``kvstore='dist_sync'``
        inside a dist_gluon ps-lite job starts a second ps-lite kvstore, which blocks
        before this error can be raised.

    Examples
    --------
    >>> kv = dg.create()
    >>> batch_size = 32                               # per worker
    >>> # equal shares (padded), so that every worker runs the same number of batches
    >>> shard = dg.ShardSampler(len(x), shuffle=False).indices()
    >>> train_iter = mx.io.NDArrayIter(x[shard], y[shard], batch_size)
    >>> mod = mx.mod.Module(symbol, context=mx.cpu())
    >>> mod.bind(data_shapes=train_iter.provide_data,
    ...          label_shapes=train_iter.provide_label)
    >>> mod.init_params(mx.init.Xavier())             # any seed: rank 0's values win
    >>> arg_params, aux_params = mod.get_params()
    >>> dg.broadcast_parameters(arg_params)
    >>> dg.broadcast_parameters(aux_params)
    >>> mod.set_params(arg_params, aux_params)
    >>> opt = dg.DistributedOptimizer(mx.optimizer.SGD(
    ...     learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / batch_size))
    >>> mod.fit(train_iter, kvstore=None, optimizer=opt, num_epoch=10)
    """

    def __init__(self, optimizer, kv=None, compression=None,
                 gradient_predivide_factor: float = 1.0, prefix: str | None = None,
                 loss_scale: float = 1.0, **optimizer_params):
        # Optimizer.__init__ is not called on purpose: every attribute it would set
        # belongs to the wrapped optimizer and is reached through __getattr__.
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("optimizer is already a DistributedOptimizer; wrapping it "
                             "again would average the gradients twice")
        if isinstance(optimizer, str):
            module_defaults = _MODULE_DEFAULTS.difference(optimizer_params)
            optimizer = mx.optimizer.create(optimizer, **optimizer_params)
        elif isinstance(optimizer, mx.optimizer.Optimizer):
            if optimizer_params:
                raise TypeError("optimizer parameters (" + ", ".join(optimizer_params)
                                + ") go with an optimizer name, e.g. DistributedOptimizer("
                                "'sgd', learning_rate=0.1); set them on the optimizer "
                                "instance instead")
            module_defaults = frozenset()
        else:
            raise TypeError("optimizer must be an mx.optimizer.Optimizer or the name of "
                            f"one, got {type(optimizer).__name__}")
        compression = check_compression(compression)
        predivide = check_predivide(gradient_predivide_factor, compression)
        kv = resolve(kv)
        self._dg_wrapped_optimizer = optimizer
        self._dg_kv = kv
        self._dg_kv_name = kv.type
        self._dg_compression = compression
        self._dg_predivide = predivide
        self._dg_prefix = claim_prefix(prefix, "opt", "optimizer")
        self._dg_averager = None
        self._dg_server_updates = None
        self._dg_steps = _timeline.UpdateSteps()
        self._dg_module_defaults = module_defaults
        # the Module that installed it, when it drives several devices (see _update)
        self._dg_module = None
        # the Module that installed it: with loss_scale='dynamic' a step's first call
        # checks all of its gradients
        self._dg_installer = None
        self._dg_dynamic = None
        self.loss_scale = loss_scale
        async_updates.check_options(kv, compression, predivide, "DistributedOptimizer",
                                    optimizer)

    # ------------------------------------------------------------ attribute forwarding
    def __getattr__(self, name):
        # Only called for attributes this object lacks. Our own (_dg_*) and dunder names
        # must not be forwarded: they are looked up before __setstate__ has run.
        if name.startswith("_dg_") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._dg_wrapped_optimizer, name)

    def __setattr__(self, name, value):
        # Module sets idx2name, gluon sets param_dict and rescale_grad, users set lr...:
        # all of it configures the wrapped optimizer, which is the one that updates.
        own = getattr(type(self), name, None)
        if name.startswith("_dg_") or (isinstance(own, property) and own.fset is not None):
            object.__setattr__(self, name, value)      # _dg_*, loss_scale
        else:
            setattr(self._dg_wrapped_optimizer, name, value)

    @property
    def loss_scale(self) -> float:
        """This rank's loss scale (see the class docstring); with ``'dynamic'`` the
        factor to multiply the next step's loss by."""
        if self._dg_dynamic is not None:
            return self._dg_dynamic.loss_scale
        return self._dg_loss_scale

    @loss_scale.setter
    def loss_scale(self, value) -> None:
        if isinstance(value, str) and value == "dynamic":
            self._dg_dynamic, self._dg_loss_scale = amp.DynamicScale(), 1.0
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"loss_scale must be a positive number, got {value!r} (or "
                             "'dynamic' for dynamic loss scaling)")
        self._dg_dynamic, self._dg_loss_scale = None, float(value)

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({self._dg_wrapped_optimizer!r}, "
                f"kv={self._dg_kv_name!r}, prefix={self._dg_prefix!r})")

    @property
    def kv(self) -> Backend:
        """The backend this optimizer communicates through."""
        if self._dg_kv is None:
            self._dg_kv = resolve(self._dg_kv_name)
        return self._dg_kv

    @property
    def learning_rate(self) -> float:
        return self._dg_wrapped_optimizer.learning_rate

    @property
    def rescale_grad(self) -> float:
        # Module.init_optimizer reads rescale_grad right after choosing its kvstore.
        self._check_installer()
        return self._dg_wrapped_optimizer.rescale_grad

    @property
    def aggregate_num(self) -> int:
        # mx.optimizer.Updater reads it when it is created, also by a KVStore.
        self._check_installer()
        return self._dg_wrapped_optimizer.aggregate_num

    # ------------------------------------------------------------ the update
    def update(self, index, weight, grad, state) -> None:
        self._observed_update(self._dg_wrapped_optimizer.update, index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state) -> None:
        self._observed_update(self._dg_wrapped_optimizer.update_multi_precision, index,
                              weight, grad, state)

    def _observed_update(self, update, index, weight, grad, state) -> None:
        """:meth:`_update`, its calls grouped into steps for the job's report and
        timeline (:class:`~dist_gluon.timeline.UpdateSteps`)."""
        rescale_grad = self._dg_wrapped_optimizer.rescale_grad
        samples = 1.0 / rescale_grad if rescale_grad else 0.0   # Module: its batch size
        _join.optimizer_update(self, index)     # dg.Join: a step announces itself
        self._dg_steps.enter(index, grad, samples)
        self._update(update, index, weight, grad, state)
        self._dg_steps.leave(samples)

    def _update(self, update, index, weight, grad, state) -> None:
        """Average ``grad`` (one NDArray, or a list for a list of indices) over the
        workers in place, then run the wrapped optimizer's ``update``.

        A Module on D devices calls the updater once per device, with index
        ``i * D + k`` for parameter ``i`` on device ``k`` (MXNet's model._update_params).
        Device 0's call sums parameter ``i``'s gradients of every device on device 0,
        averages that over the workers under key ``i`` and copies the result back to
        the other devices; their calls then only update."""
        inner = self._dg_wrapped_optimizer
        averager = self._dg_averager
        if averager is None:
            averager = self._dg_averager = _GradientAverager(
                self.kv, self._dg_prefix, self._dg_compression, self._dg_predivide,
                owner="DistributedOptimizer")
            if async_updates.asynchronous(self.kv):
                self._dg_server_updates = async_updates.ServerUpdates(
                    self.kv, "DistributedOptimizer")
        indices = list(index) if isinstance(index, (list, tuple)) else [index]
        grads = list(grad) if isinstance(grad, (list, tuple)) else [grad]
        dynamic = self._dg_dynamic
        if dynamic is not None and dynamic.begin(
                indices, self._step_grads, averager, 1.0 / inner.rescale_grad,
                alone=not averager.distributed or self._dg_server_updates is not None):
            return      # overflowed on some rank: every rank skips this step
        devices = self._devices()
        if devices > 1:
            if indices[0] % devices:
                # devices 1..D-1: device 0's call left the average in these gradients
                self._update_unscaled(update, index, weight, grad, state)
                return
            grads = [self._device_sum(i // devices) for i in indices]
            indices = [i // devices for i in indices]
        describe = self._describe if devices == 1 else \
            (lambda i: self._describe(i * devices))
        if averager.codec is not None:
            # a gradient the codec refuses fails on one process too, not first on N
            averager.check_input(indices, grads, describe)
        rescale_grad, scale = inner.rescale_grad, self._dg_loss_scale
        weight_of_rank = 1.0 / (rescale_grad * scale)   # its batch size
        if dynamic is not None:
            # rescale_grad is 1 / batch size; the optimizer divides the scale out
            scale, weight_of_rank = dynamic.step_scale, 1.0 / rescale_grad
            if not averager.distributed or self._dg_server_updates is not None:
                for g in grads:
                    g *= 1.0 / scale
        if not averager.distributed:
            self._spread(indices)
            update(index, weight, grad, state)
            return
        if self._dg_server_updates is not None:
            weights = list(weight) if isinstance(weight, (list, tuple)) else [weight]
            # the servers update; this rank's rescale_grad is its own batch size
            self._dg_server_updates.step(indices, grads, weights, inner.rescale_grad, inner,
                                         describe=describe)
            return
        if scale != 1.0:
            for g in grads:
                g *= 1.0 / scale
        # the averaged gradient is already divided by the sum of the batch sizes: the
        # update must not rescale it by this rank's own batch size again (rescaling by
        # 1 keeps every rank's update identical, bit for bit)
        averager.reduce(indices, grads, weight=weight_of_rank, describe=describe)
        self._spread(indices)
        self._update_unscaled(update, index, weight, grad, state)

    def _update_unscaled(self, update, index, weight, grad, state) -> None:
        """The wrapped optimizer's update of gradients already divided by the summed
        batch sizes (``rescale_grad`` 1 for this call); on one process as it is."""
        inner = self._dg_wrapped_optimizer
        if not self._dg_averager.distributed or self._dg_server_updates is not None:
            update(index, weight, grad, state)
            return
        rescale_grad = inner.rescale_grad
        inner.rescale_grad = 1.0
        try:
            update(index, weight, grad, state)
        finally:
            inner.rescale_grad = rescale_grad

    def _step_grads(self) -> list:
        """Every gradient of the installing Module (all devices), for the overflow
        check of ``loss_scale='dynamic'``."""
        module = self._dg_installer
        if module is None:
            raise RuntimeError(
                "DistributedOptimizer(loss_scale='dynamic') checks every gradient of a "
                "step at its first update, so it must be installed by a Module: "
                "mod.init_optimizer(kvstore=None, optimizer=opt) or mod.fit(..., "
                "kvstore=None, optimizer=opt)")
        return [g for per_device in module._exec_group.grad_arrays
                for g in per_device if g is not None]

    # ------------------------------------------------------------ several devices
    def _devices(self) -> int:
        module = self._dg_module
        return 1 if module is None else len(module._context)

    def _device_grads(self, param: int) -> list:
        return self._dg_module._exec_group.grad_arrays[param]

    def _device_sum(self, param: int) -> mx.nd.NDArray:
        return sum_into_first(self._device_grads(param))

    def _spread(self, params: list[int]) -> None:
        if self._dg_module is not None:
            for param in params:
                copy_from_first(self._device_grads(param))

    def _describe(self, index) -> str:
        name = self._dg_wrapped_optimizer.idx2name.get(index)
        return f"parameter #{index}" + (f" ({name!r})" if name else "")

    # ------------------------------------------------------------ forwarded methods
    # Optimizer's own implementations would run on this wrapper; forwarding keeps the
    # wrapped optimizer's overrides (LARS' _get_lrs, set_wd_mult...).
    def create_state(self, index, weight):
        return self._dg_wrapped_optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._dg_wrapped_optimizer.create_state_multi_precision(index, weight)

    def set_learning_rate(self, lr: float) -> None:
        self._dg_wrapped_optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: dict) -> None:
        self._dg_wrapped_optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict) -> None:
        self._dg_wrapped_optimizer.set_wd_mult(args_wd_mult)

    def _set_current_context(self, device_id):
        self._dg_wrapped_optimizer._set_current_context(device_id)

    def _update_count(self, index):
        self._dg_wrapped_optimizer._update_count(index)

    def _get_lrs(self, indices):
        return self._dg_wrapped_optimizer._get_lrs(indices)

    def _get_lr(self, index):
        return self._dg_wrapped_optimizer._get_lr(index)

    def _get_wds(self, indices):
        return self._dg_wrapped_optimizer._get_wds(indices)

    def _get_wd(self, index):
        return self._dg_wrapped_optimizer._get_wd(index)

    # ------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        # A dist KVStore pickles the optimizer to run it on its servers.
        self._check_installer()
        state = {k: v for k, v in self.__dict__.items() if k.startswith("_dg_")}
        state["_dg_kv"] = None          # the copy finds its backend when first used
        state["_dg_averager"] = None
        state["_dg_server_updates"] = None
        state["_dg_module"] = None
        state["_dg_installer"] = None
        state.pop("_dg_steps", None)    # a step in progress is this process's
        return state

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "_dg_steps", _timeline.UpdateSteps())
        for name, value in state.items():
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------ misuse
    def _check_installer(self) -> None:
        """Refuse to be installed with a kvstore; adopt Module's defaults otherwise.

        MXNet tells an optimizer nothing about who uses it, so the callers' frames are
        read: Module.init_optimizer reads ``rescale_grad`` right after choosing its
        kvstore (its local ``kvstore``: None for ``kvstore=None``, and for 'local' with
        one device), and a KVStore's ``set_optimizer`` pickles the optimizer (dist) or
        builds an Updater from it (local).
        """
        frame = sys._getframe(2)
        for _ in range(_INSTALLER_DEPTH):
            if frame is None:
                return
            if frame.f_code is _MODULE_INIT_OPTIMIZER:
                self._check_module(frame.f_locals)
                return
            owner = frame.f_locals.get("self")
            if frame.f_code.co_name == "set_optimizer" and isinstance(owner, KVStoreBase):
                raise ValueError(f"a DistributedOptimizer was given to a {owner.type!r} "
                                 f"kvstore (set_optimizer). {_KVSTORE_HELP}")
            frame = frame.f_back

    def _check_module(self, init_locals: dict) -> None:
        module = init_locals.get("self")
        contexts = getattr(module, "_context", [])
        kvstore = init_locals.get("kvstore")
        if kvstore is not None:
            several = (f" (a Module on {len(contexts)} devices makes even kvstore='local' "
                       "a kvstore: pass kvstore=None; DistributedOptimizer sums the "
                       "devices itself)") if len(contexts) > 1 else ""
            raise ValueError(f"a DistributedOptimizer was installed with the "
                             f"{getattr(kvstore, 'type', kvstore)!r} kvstore{several}. "
                             + _KVSTORE_HELP)
        if len(contexts) > 1:
            if async_updates.asynchronous(self.kv):
                raise ValueError(f"on dist_async the servers update one copy of the weights "
                                 f"per worker, but the Module has the contexts {contexts}; "
                                 "use one device per worker there (or dist_sync)")
            self._dg_module = module
        self._dg_installer = module     # its devices; dg.Join shadows its update()
        self._adopt_module_defaults(init_locals)

    def _adopt_module_defaults(self, init_locals: dict) -> None:
        """Set up an optimizer created from a name as Module sets up ``optimizer=name``:
        ``opt.create(name, sym=symbol, param_idx2name=idx2name, rescale_grad=1/batch_size,
        **optimizer_params)``, keeping what the user gave or set since."""
        defaults = self._dg_module_defaults
        if not defaults:
            return
        inner = self._dg_wrapped_optimizer
        if "rescale_grad" in defaults:
            inner.rescale_grad = init_locals["rescale_grad"]
        if "param_idx2name" in defaults:
            inner.idx2name = dict(init_locals["idx2name"])
        if "sym" in defaults:
            symbol = init_locals["self"].symbol
            inner.sym_info = (symbol.attr_dict(), symbol.list_arguments())
        # the multipliers set so far are the user's (set_lr_mult...); the defaults that
        # come from the names and the symbol go under them, as in Optimizer.__init__
        inner.set_lr_mult(dict(inner.lr_mult))
        inner.set_wd_mult(dict(inner.wd_mult))
