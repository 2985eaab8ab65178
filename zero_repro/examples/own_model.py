# ZeRO stage 3 on your own model with your own torch optimizer and scheduler (the README's
# "Use ZeRO on your own model"): torchrun --nproc_per_node 2 -m zero_repro.examples.own_model
import torch
import torch.nn.functional as F
from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig
from zero_repro.runtime.comm import launch
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.train import checkpoint
from zero_repro.runtime.zero import build_strategy


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self, vocab=256, d=64, n=4):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        h = self.emb(x)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def train() -> None:
    """The README's code (between the markers), as written there."""
    # --8<-- [start:own-model]
    launch.init_from_env("gloo")  # "nccl" on GPUs
    topo = Topology.build(tp=1)  # every rank is a data-parallel rank
    with torch.device("meta"):  # no storage: built unit by unit on the device by the strategy
        model = Net()
    decay = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT's recipe, as unwrapped
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    strategy = build_strategy(
        model, topo, ZeroConfig(stage=3, grad_clip=1.0), TrainConfig(), device="cpu",
        units=list(model.layers),  # gathered / freed one by one (the default finds them too)
        optimizer=opt)  # moved onto this rank's fp32 shard (strategy.optimizer is opt)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    start, ckpt = 0, checkpoint.latest("own_model_ckpt")
    if ckpt:  # resume: parameters, optimizer, scheduler, data position (any stage / DP size)
        start = checkpoint.load(ckpt, strategy, topo, stateful={"sched": sched})["step"]
    gen = torch.Generator().manual_seed(topo.dp_rank)  # each DP rank its own data
    for _ in range(start, start + 20):
        x = torch.randint(0, 256, (8, 32), generator=gen)
        loss = F.cross_entropy(strategy(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        strategy.backward(loss)  # or several backward calls (or no_sync()) to accumulate
        strategy.step()
        strategy.zero_grad()
        sched.step()
    checkpoint.save("own_model_ckpt", strategy, topo, step=start + 20, stateful={"sched": sched})
    with strategy.gathered(writeback=True), torch.no_grad():  # a write that the master keeps
        model.head.bias.zero_()
    full = strategy.full_state_dict()  # the model's own keys in fp32, on rank 0
    if topo.rank == 0:
        Net().load_state_dict(full, strict=True)
        print(f"loss {loss.item():.3f}, lr {sched.get_last_lr()[0]:.2e}, {len(full)} tensors")
    # --8<-- [end:own-model]
    strategy.remove_hooks()  # the hooks hold the strategy, its groups: gone before the teardown


def main() -> None:
    """Everything of the run inside a function: its objects (process groups among them) are
    gone when it returns, before the interpreter's own teardown."""
    try:
        train()
    finally:
        launch.teardown()


if __name__ == "__main__":
    main()
