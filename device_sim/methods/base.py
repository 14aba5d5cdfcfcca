"""The method interface of the simulator: what a federated method must say so the round
loop (:mod:`device_sim.federation`) and the executors (:mod:`device_sim.executors`) can run
it without knowing its equations.

A round, Flower/pfl style ("configure the round" / "train" / "aggregate"):

1. ``configure_round(round, participants)`` → :class:`RoundPlan` — what the server
   broadcasts besides the global weights (``plan.extras``: e.g. FedUV's ``λ_neg`` of this
   round, PrivacyFace's DP cluster centres).
2. each participant trains the parameter *groups* of :meth:`FederatedMethod.initial_params`
   with :meth:`FederatedMethod.objective` (a pure function of the parameters, so the
   batched executor can ``vmap`` it over clients) and per-client constants
   (:meth:`FederatedMethod.client_consts`: codeword, ``ℓ_neg`` codewords, a private class
   embedding…).
3. the ``"global"`` group is averaged with weighted FedAvg (``server_agg.aggregate``,
   FedFS Eq. 1) — everything a method wants the server to average lives there (FedAwS's
   class embeddings included); groups in ``private_groups`` stay on the device (the client
   store keeps them across rounds, e.g. FedFS's ``θ_c``). Each trained chunk is also
   handed to :meth:`FederatedMethod.receive` (per-client uploads the server reads: FedAwS /
   FedGC class embeddings, PrivacyFace's DP centres; a no-op by default).
4. ``server_update(aggregated, plan)`` — a server-side step after averaging (FedAwS
   spread-out step, FedGC correction); identity by default.

Evaluation asks :meth:`FederatedMethod.verifier` for each client's :class:`VerifierSpec`.

Parameters travel as ``Params = {group: {name: tensor}}``. ``"global"`` is the group the
server averages; ``"personal"`` the FedFS personalized model.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet

Weights = dict[str, torch.Tensor]
Params = dict[str, Weights]


@dataclass
class SimContext:
    """What every method may use: the base architecture (ξ's), ξ itself, the population.

    Attributes:
        model_config: architecture of ξ (backbone, embedding size, input size); methods
            derive their global model from it (adding the FedFS projection / FedUV head).
        xi: the frozen pre-trained model ``ξ(ψ)`` (a :class:`FaceNet`), eval mode, no grad.
        num_clients: number of clients in the federation (one identity each).
        seed: experiment seed; every random choice of a method derives from it.
        device: where the global model lives during training.
    """

    model_config: ModelConfig
    xi: FaceNet
    num_clients: int
    seed: int = 0
    device: str = "cpu"


@dataclass
class ClientState:
    """Per-client constants of a method that never change across rounds (codeword…).

    ``codeword`` is the FedUV secret ``v_u`` (±1 int8); it is regenerated on demand from
    ``(seed, client)`` rather than stored, so 10,000 clients cost nothing here.
    """

    client: int
    codeword: np.ndarray | None = None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundPlan:
    """What the server decided for one round and broadcasts with the global weights."""

    round: int
    participants: np.ndarray
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class VerifierSpec:
    """How one client verifies: a :class:`VerifierNet` skeleton, the weights to run in it,
    and the decision mode (codeword when ``codeword`` is set, else a cosine template).

    ``shared_key`` names weights that are identical across clients (the global model, ξ):
    evaluation embeds once per key instead of once per client.
    """

    net: VerifierNet
    weights: Weights
    codeword: np.ndarray | None = None
    shared_key: str | None = None
    reference: torch.Tensor | None = None
    """Template mode with a fixed reference embedding ``[D]`` (a class embedding ``w_y`` of
    the baselines in :mod:`device_sim.methods.baselines`): score ``cos(embedding,
    reference)`` instead of a template enrolled from warm-up images. The warm-up threshold
    rule is unchanged."""

    trunk: Any = None
    """``scope="top"`` methods (:mod:`fedfs_sdk.training.scope`): a callable giving ξ's trunk
    features of images (cached, :mod:`device_sim.trunk_cache`); evaluation then runs only
    :attr:`top` on them. ``net``/``weights`` still describe the whole verifier."""
    top: nn.Module | None = None
    """The part of ``net`` after the trunk (same parameter names, top-only subset)."""

    @property
    def mode(self) -> str:
        return "codeword" if self.codeword is not None else "template"


class FederatedMethod(ABC):
    """A federated method: subclass and implement the abstract hooks.

    Class attributes:
        name: registry name (``fedfs``, ``feduv``…).
        trains: False for methods that only evaluate (``pretrained``).
        private_groups: parameter groups kept per client across rounds (client store);
            the ``"global"`` group is the one the server averages.
    """

    name: str = "method"
    trains: bool = True
    private_groups: tuple[str, ...] = ()
    local_only: bool = False
    """True for a per-client baseline with no federation (``local-compact``): the loop runs
    one round in which every client trains once, and the server never changes ``global``."""

    def __init__(self) -> None:
        self.ctx: SimContext | None = None

    # ---- set-up ------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """Human-readable name with options (table rows, plot legends)."""
        return self.name

    def options(self) -> dict[str, Any]:
        """JSON-able options (written to results.json and checked on resume)."""
        return {}

    def setup(self, ctx: SimContext) -> None:
        """Bind the context and build module skeletons. Called once before round 1."""
        self.ctx = ctx

    def prepare(self, data: Any) -> None:
        """Called once by the federation after :meth:`setup` with its client data (a
        :class:`device_sim.population.Population` in the CLI). Methods that fit something
        before the rounds or instead of them (``norm-adapt``'s pooled statistics, the
        ``oracle``'s supervised fine-tune) do it here; a no-op by default."""

    def trained_groups(self) -> tuple[str, ...] | None:
        """Parameter groups the local objective differentiates (``None``: all). The others
        are carried through a client's local training unchanged."""
        return None

    def trains_tensor(self, group: str, name: str) -> bool:
        """Whether tensor ``name`` of a trained group moves in local training. ``False`` marks a
        frozen tensor inside a trained group (``scope="top"``: the trunk, which stays ξ's): the
        executors neither differentiate nor step it, so it leaves local training unchanged."""
        return True

    def frozen_stem(self) -> nn.Module | None:
        """A frozen module that every model of the objective applies to the images first
        (``scope="top"``: ξ's trunk, shared by ξ, the global and the personalized model), or
        None. Its outputs never change, so the batched executor computes them once per image
        per chunk and calls the objective with ``features["trunk"]`` (and ``x`` None) instead of
        running the stem at every local step."""
        return None

    def xi_after_stem(self) -> nn.Module | None:
        """ξ's layers after :meth:`frozen_stem` (``ξ(x) = xi_after_stem(frozen_stem(x))``), so ξ's
        features come from the stem's outputs without running ξ's trunk again; None: from images."""
        return None

    @property
    def context(self) -> SimContext:
        if self.ctx is None:
            raise RuntimeError(f"method {self.name!r} used before setup(ctx)")
        return self.ctx

    @abstractmethod
    def init_global(self) -> Weights:
        """Round-0 weights of the averaged model (``w`` of FedFS Eq. 1)."""

    def init_private(self, global_weights: Weights) -> Params:
        """The private groups of a client that has never trained (same for every client)."""
        return {}

    def client_state_init(self, client: int) -> ClientState:
        """Constants of ``client`` (e.g. its FedUV codeword); deterministic in (seed, client)."""
        return ClientState(client)

    # ---- one round ---------------------------------------------------------------------
    def configure_round(self, round_idx: int, participants: np.ndarray) -> RoundPlan:
        """Server side, before local training: the broadcast extras of this round."""
        return RoundPlan(round_idx, participants)

    def client_consts(self, plan: RoundPlan, state: ClientState) -> dict[str, torch.Tensor]:
        """Per-client tensors the objective reads (stacked over clients by the batched
        executor, so every client of a round must give the same shapes)."""
        return {}

    @abstractmethod
    def objective(self, plan: RoundPlan, params: Params, consts: Mapping[str, torch.Tensor],
                  x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one batch of one client, a pure function of ``params`` (no module state),
        so it can be differentiated with ``torch.func.grad`` and ``vmap``-ed over clients.
        ``mask`` marks the real samples of a padded batch.

        A method that declares :meth:`xi_model`, :meth:`trunks` or :meth:`frozen_stem` also
        takes ``features={"xi": v, <group>: backbone output, "trunk": stem output}`` — what the
        executor computed outside the per-client function for this batch — and then must not
        compute it again."""

    def xi_model(self) -> nn.Module | None:
        """The frozen model whose outputs ``v = ξ(x)`` the objective reads (FedFS Eq. 2), or
        None. ξ never changes, so the federation computes ``v`` once per image and passes it as
        ``features["xi"]`` instead of running ξ at every local step."""
        return None

    def trunks(self) -> dict[str, nn.Module]:
        """``{group: backbone}`` for groups whose model is ``backbone`` (parameters
        ``backbone.*``) followed by a head the objective applies to its output. The batched
        executor may then run the backbones of a whole chunk as one client-folded network
        (:mod:`device_sim.executors.folding`) and call the objective with
        ``features={group: output}``. Empty: the objective runs whole models (vmap)."""
        return {}

    def learning_rate(self, group: str, name: str, base_lr: float, head_lr: float | None) -> float:
        """Learning rate of one tensor (``head_lr`` lets a randomly started head move faster)."""
        return base_lr

    def default_lr(self) -> float:
        return 5e-3

    def default_head_lr(self) -> float | None:
        """Learning rate of a randomly started head when ``LocalConfig.head_lr`` is None
        (``fedfs_sdk.training.trainer.TrainConfig``'s 0.1; ``None`` would mean the base lr)."""
        return 0.1

    def default_local_epochs(self) -> int:
        return 2

    def min_batch(self) -> int:
        """Smallest batch that makes sense (FedFS contrasts within a batch: 2)."""
        return 1

    def receive(self, plan: RoundPlan, clients: Sequence[int], params: Params,
                num_samples: torch.Tensor) -> None:
        """Server side, after each trained chunk: the chunk's trained weights, stacked
        ``[K, ...]`` per tensor for every group, in ``clients`` order. For methods whose
        server reads per-client uploads (FedAwS/FedGC class embeddings, PrivacyFace DP
        cluster centres); a no-op by default. Called before :meth:`server_update`."""

    def server_update(self, aggregated: Weights, plan: RoundPlan) -> Weights:
        """Server step after FedAvg (FedAwS, FedGC corrections). Identity by default."""
        return aggregated

    def server_state(self) -> dict[str, torch.Tensor]:
        """Method state kept by the server across rounds (saved in checkpoints)."""
        return {}

    def load_server_state(self, state: Mapping[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"method {self.name!r} has no server state, got keys {sorted(state)[:5]}")

    # ---- evaluation --------------------------------------------------------------------
    def prepare_evaluation(self, global_weights: Weights, private: Any, clients: Sequence[int]) -> None:
        """Called by :func:`device_sim.evaluate.evaluate` before it asks for any client's verifier,
        with the final weights (``private(c)``: client ``c``'s private groups) and the clients it
        will evaluate — for decisions that need every client first (the do-no-harm check's
        federation-wide evidence, :mod:`device_sim.methods.selection`). A no-op by default."""

    @abstractmethod
    def verifier(self, state: ClientState, global_weights: Weights, private: Params | None) -> VerifierSpec:
        """How ``state.client`` verifies after training (``private`` is None for a client
        with no stored state)."""

    def new_user_verifier(self, state: ClientState, global_weights: Weights) -> VerifierSpec:
        """How a user who never took part verifies with the model the server ships."""
        return self.verifier(state, global_weights, None)

    def new_user_choice(self, state: ClientState, global_weights: Weights, enroll_x: torch.Tensor
                        ) -> tuple[VerifierSpec, str | None]:
        """The verifier a new user enrolls with and which candidate it is (None: the method has no
        choice, the shipped model). Methods with do no harm override it."""
        return self.new_user_verifier(state, global_weights), None


def backbone_weights(weights: Mapping[str, torch.Tensor], prefix: str = "backbone.") -> Weights:
    """``backbone.*`` entries of a FaceNet state dict, with the prefix kept."""
    return {k: v for k, v in weights.items() if k.startswith(prefix)}


def verifier_net(config: ModelConfig, with_head: bool, project: bool = False) -> VerifierNet:
    """A VerifierNet skeleton whose parameter names match a FaceNet state dict
    (``backbone.*`` and ``uv_head.weight``); ``project``: its embedding is ``W·e``."""
    face = FaceNet(config)
    return VerifierNet(face.backbone, face.uv_head if with_head else None, project=project)


def frozen(module: nn.Module) -> nn.Module:
    return module.eval().requires_grad_(False)
