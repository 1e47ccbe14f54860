"""What a persistent worker keeps between rounds: model, optimizer, data, reducer and layout.

A persistent site worker (:mod:`clients.pool`) trains many rounds. Like a DDP process, which
builds its model, its ``Reducer`` and its data loader once and then runs many iterations (Li et
al. 2020, "PyTorch Distributed", VLDB, section 4.1), it keeps in one :class:`WorkerState`:

* the model object (each round loads the new global weights into it, in place);
* the site's data (``Task.data`` is called once per pool, not once per round) and, with
  per-shard loaders, this worker's loader for its ``(rank, world_size)``;
* the gradient reducer, while the process group is the same (its buckets, hooks and thread),
  and the reducer's learned state (:meth:`clients.buckets.GradReducer.state_dict`: the layout
  rebuilt from the observed gradient order and ``auto``'s choice) across group changes;
* with ``site.keep_optimizer``, the optimizer's state (momentum buffers, Adam moments).
  Default: a fresh optimizer every round, Flower's convention for local training (the server
  owns the model's trajectory; a client's local optimizer starts fresh each round, as in
  McMahan et al. 2017, Algorithm 1, and Flower's examples).

:meth:`WorkerState.release_group` drops every reference to the current communicator (the
reducer's thread, hooks and buckets) so that a broken torch.distributed group can be freed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from clients.buckets import GradReducer
from fedagg.collectives import Communicator
from fedagg.task import SiteData, SiteInfo, Task, TrainSettings, set_weights

__all__ = ["WorkerState"]


@dataclass
class WorkerState:
    """One worker's state between rounds (see the module docstring); no live handles leave it.

    Attributes
    ----------
    model : torch.nn.Module or None
        The worker's model, built once by ``Task.model``.
    optimizer : torch.optim.Optimizer or None
        The last round's optimizer.
    optimizer_rounds : int
        Rounds of optimizer state the current optimizer carries (0: fresh).
    pending_optimizer : dict or None
        An optimizer ``state_dict`` to adopt at the next round (a replacement worker joins
        with its peers' state).
    layout : dict or None
        The reducer's state (layout, ``auto`` choice) and the world size it was learned for.
    rounds : int
        Rounds this worker trained (successfully).
    """

    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    optimizer_rounds: int = 0
    pending_optimizer: dict[str, Any] | None = None
    layout: dict[str, Any] | None = None
    rounds: int = 0
    _opt_start: tuple[int, dict[str, Any]] | None = None
    _reducer: GradReducer | None = None
    _reducer_comm: Communicator | None = None
    _reducer_cfg: tuple[Any, ...] | None = None
    _data: SiteData | None = None
    _data_key: SiteInfo | None = None
    _loader: Iterable[Any] | None = None
    _loader_key: tuple[int, int] | None = None

    # -- model and data -----------------------------------------------------------------------
    def prepare_model(self, task: Task, weights: Any, device: torch.device) -> nn.Module:
        """The worker's model with this round's global ``weights`` (built on first use)."""
        if self.model is None:
            self.model = task.model()
        set_weights(self.model, weights)
        self.model.to(device)
        self.model.train()
        return self.model

    def site_data(self, task: Task, site: SiteInfo) -> SiteData:
        """The site's data, built once per site (``Task.data``)."""
        if self._data is None or self._data_key != site:
            self._data, self._data_key = task.data(site), site
            self._loader = self._loader_key = None
        return self._data

    def loader(self, data: SiteData, rank: int, world: int) -> Iterable[Any]:
        """This worker's loader of ``data.train_loader(rank, world)``, built once per shard."""
        assert data.train_loader is not None
        if self._loader is None or self._loader_key != (rank, world):
            self._loader, self._loader_key = data.train_loader(rank, world), (rank, world)
        return self._loader

    # -- optimizer ----------------------------------------------------------------------------
    def prepare_optimizer(self, task: Task, model: nn.Module, settings: TrainSettings, *,
                          keep: bool, redo: bool) -> torch.optim.Optimizer:
        """The round's optimizer: fresh, or (``keep``) carrying the previous rounds' state.

        The optimizer is always made by the task's factory with this round's settings (so a
        server's new ``lr`` applies); with ``keep`` it then adopts the kept per-parameter
        state. ``redo`` (the round is trained again after a lost worker) restores the state
        as it was at the start of the round.
        """
        opt = task.make_optimizer(model.parameters(), settings)
        if not keep:
            self.optimizer, self.optimizer_rounds, self._opt_start = opt, 0, None
            return opt
        rounds, base = 0, None
        if self.pending_optimizer is not None:
            base, rounds = self.pending_optimizer.get("state"), int(self.pending_optimizer.get("rounds", 0))
            self.pending_optimizer = None
        elif redo and self._opt_start is not None:
            rounds, saved = self._opt_start
            base = copy.deepcopy(saved)["state"]
        elif self.optimizer is not None:
            rounds, base = self.optimizer_rounds, self.optimizer.state_dict()["state"]
        if base:
            sd = opt.state_dict()
            sd["state"] = base
            opt.load_state_dict(sd)
        self._opt_start = (rounds, copy.deepcopy(opt.state_dict()))
        self.optimizer, self.optimizer_rounds = opt, rounds
        return opt

    def finish_round(self, keep: bool) -> None:
        """Count a successful round (the kept optimizer state now covers one more)."""
        self.rounds += 1
        if keep:
            self.optimizer_rounds += 1

    def optimizer_state(self) -> dict[str, Any] | None:
        """The kept optimizer state (for a replacement worker), or None."""
        if self.optimizer is None:
            return None
        return {"state": copy.deepcopy(self.optimizer.state_dict()["state"]),
                "rounds": self.optimizer_rounds}

    # -- reducer ------------------------------------------------------------------------------
    def reducer(self, model: nn.Module, comm: Communicator, *,
                hooks: tuple[Any, Any] = (None, None), **options: Any) -> GradReducer:
        """The gradient reducer over ``comm``; reused while the group, the options and the
        task's comm hook (``hooks = (comm_hook, hook_state)``, compared by identity) stay."""
        cfg = (*sorted(options.items()), *(id(h) for h in hooks))
        if self._reducer is not None and self._reducer_comm is comm and self._reducer_cfg == cfg:
            return self._reducer
        self.release_group()
        reducer = GradReducer(model.parameters(), comm, comm_hook=hooks[0], hook_state=hooks[1],
                              **options)
        if self.layout is not None:
            state: dict[str, Any] = {k: v for k, v in self.layout.items() if k != "world"}
            if self.layout.get("world") != comm.world_size:
                state["auto_choice"] = None  # probed for another number of workers
            reducer.load_state_dict(state)
        self._reducer, self._reducer_comm, self._reducer_cfg = reducer, comm, cfg
        return reducer

    def remember_layout(self) -> dict[str, Any] | None:
        """Store (and return) the reducer's learned state with its world size."""
        if self._reducer is not None and self._reducer_comm is not None:
            self.layout = {"world": self._reducer_comm.world_size, **self._reducer.state_dict()}
        return self.layout

    def adopt_layout(self, layout: Mapping[str, Any] | None) -> None:
        """Use ``layout`` (the site's agreed reducer state) for the next reducer."""
        self.layout = dict(layout) if layout is not None else None

    def release_group(self) -> None:
        """Close the reducer and drop the communicator (the group may then be destroyed)."""
        if self._reducer is not None:
            self._reducer.close()
        self._reducer = self._reducer_comm = self._reducer_cfg = None
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None  # views of the closed reducer's buckets
