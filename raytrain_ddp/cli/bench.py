"""`raytrain bench ...`: the benchmarks' options, checked here; bench/ runs them. They print figures
and assert nothing about speed. Each imports its runner late: they pull in torch or Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from raytrain_ddp.bench.data import CLASSES, TINY_IMAGES, bench_data
from raytrain_ddp.cli.options import train_options
from raytrain_ddp.config import ConfigError, TrainConfig


@train_options(own_flags=("model", "dataset", "image_size", "batch_size", "train_samples", "val_samples"))
def overhead_command(
    cfg: TrainConfig,
    regime: str = typer.Option("compute,input,overhead", "--regime", help="Regimes to run, comma-separated: "
                               "compute (a step of 200 ms or more), input (JPEG decoding), overhead (a step of a few ms)."),
    rounds: int = typer.Option(3, "--rounds", help="A/B rounds per regime; each runs both arms."),
    model: Optional[str] = typer.Option(None, "--model", help="Every regime's model, instead of its own."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Every regime's data instead of its own: imagefolder "
                                          "(--data-dir, or JPEGs made here) or PKG.MODULE:CALLABLE."),
    image_size: Optional[int] = typer.Option(None, "--image-size", help="Image side, instead of each regime's own."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Per-rank batch, instead of each regime's own."),
    train_samples: Optional[int] = typer.Option(None, "--train-samples", help="Training samples (or JPEGs made) per "
                                                "epoch, instead of each regime's own (sized for ~10 s epochs on 2 CPUs)."),
    val_samples: Optional[int] = typer.Option(None, "--val-samples", help="Validation samples of the in-memory regimes."),
    launch: bool = typer.Option(False, "--launch", help="A third arm: the same hand-written loop under `raytrain "
                                "launch` instead of torchrun."),
) -> None:
    """`raytrain run` on a running Ray against the DDP loop a user writes by hand under torchrun, in
    three regimes: first step, steady samples/s, whole run, niceness, machine load."""
    from raytrain_ddp.bench.overhead import bench_overhead
    from raytrain_ddp.bench.regimes import REGIMES

    chosen = [r.strip() for r in regime.split(",") if r.strip()]
    if not chosen or any(r not in REGIMES for r in chosen):
        raise ConfigError(f"--regime {regime!r}: choose from {', '.join(REGIMES)}, comma-separated")
    if rounds < 1:
        raise ConfigError(f"--rounds must be at least 1 (got {rounds})")
    if dataset is not None and dataset != "imagefolder" and ":" not in dataset:
        raise ConfigError(f"--dataset {dataset}: the hand loop reads imagefolder or your own PKG.MODULE:CALLABLE")
    if cfg.gpu:
        import torch

        if torch.cuda.device_count() < cfg.workers:
            raise ConfigError(
                f"bench overhead --gpu runs on this machine, which has {torch.cuda.device_count()} GPUs "
                f"for --workers {cfg.workers}; lower --workers or drop --gpu"
            )
    overrides = dict(model=model, dataset=dataset, image_size=image_size, batch_size=batch_size,
                     train_samples=train_samples, val_samples=val_samples)
    bench_overhead(cfg, chosen, rounds, overrides, launch)


def data_command(
    images: int = typer.Option(10_000, help="How many 64x64 JPEGs to generate (1 in 50 held out for val)."),
    tiny: bool = typer.Option(False, "--tiny", help=f"{TINY_IMAGES} images, batch 32: a smoke test for CI."),
    cpus: int = typer.Option(0, help="Loader CPUs: DataLoader workers, and the private Ray's CPUs (0 = all)."),
    batch_size: int = typer.Option(256, help="Images per batch."),
    passes: int = typer.Option(4, help="Passes per path; the cheapest after the first (warm-up) is reported."),
    address: Optional[str] = typer.Option(None, help="Use this Ray cluster for the ray path (default: a private one)."),
    workdir: Optional[Path] = typer.Option(None, help="Keep the generated images here (and reuse them next time)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
) -> None:
    """CPU microseconds per training image of each ingest path, against a plain torchvision Dataset +
    DataLoader over the same data: synthetic images, an image folder of JPEGs, and Parquet shards."""

    if tiny:
        images, batch_size = TINY_IMAGES, 32
    if images < 2 * CLASSES or batch_size < 1 or passes < 1 or cpus < 0:
        raise ConfigError(f"need --images >= {2 * CLASSES}, --batch-size >= 1, --passes >= 1 and --cpus >= 0")
    report = bench_data(images=images, cpus=cpus or None, batch_size=batch_size, passes=passes, address=address,
                        workdir=workdir)
    if json_path:
        json_path.write_text(json.dumps(report, indent=2) + "\n")


def startup_scale_command(
    workers: str = typer.Option("2,8,16", "--workers", help="World sizes, comma-separated."),
    nodes: int = typer.Option(8, "--nodes", help="Ray nodes to start on this machine (a head and joined nodes)."),
    cpus_per_node: int = typer.Option(2, "--cpus-per-node", help="Logical CPUs per simulated node."),
    rounds: int = typer.Option(1, "--rounds", help="Rounds; each runs every size and control arm."),
) -> None:
    """Start-up stages at each world size on a simulated multi-node Ray, with control arms for Ray's
    share and the imports' share."""
    from raytrain_ddp.bench.startup_scale import bench_startup_scale
    from raytrain_ddp.driver.run.scale import parse_sizes

    sizes = parse_sizes(workers)
    if rounds < 1 or nodes < 1 or cpus_per_node < 1:
        raise ConfigError("--rounds, --nodes and --cpus-per-node must each be at least 1")
    if max(sizes) > nodes * cpus_per_node:
        raise ConfigError(f"--workers {max(sizes)} needs {max(sizes)} CPUs; raise --nodes or --cpus-per-node")
    bench_startup_scale(sizes, nodes, cpus_per_node, rounds)


def sharded_command(
    ranks: int = typer.Option(2, "--ranks", help="gloo ranks on this machine, one process each (no Ray)."),
    width: int = typer.Option(4096, "--width", help="The MLP's hidden width."),
    depth: int = typer.Option(6, "--depth", help="Hidden layers of width x width."),
    batch: int = typer.Option(32, "--batch", help="Samples per rank per step."),
    steps: int = typer.Option(8, "--steps", help="Steps per variant."),
    save_at: int = typer.Option(3, "--save-at", help="The step that saves a checkpoint."),
    threads: int = typer.Option(1, "--threads", help="torch threads per rank."),
    checkpoint_dir: Optional[str] = typer.Option(None, "--dir", help="Where the checkpoint is written (default: $TMPDIR)."),
    variants: str = typer.Option("ddp,fsdp-sync,fsdp-async", "--variants", help="Variants to run, comma-separated."),
) -> None:
    """The checkpoint stall and the state per rank, DDP against FSDP, on a wide MLP (no Ray, no data).

    Each variant trains --steps steps and saves once, at --save-at: ddp (rank 0 writes the whole
    state), fsdp-sync (every rank writes its shards) and fsdp-async (written by a thread while
    training goes on). It prints the median step, the save step's stall and the state per rank.
    """
    from raytrain_ddp.bench.sharded import VARIANTS, Settings, bench_sharded

    chosen = tuple(v.strip() for v in variants.split(",") if v.strip())
    if unknown := [v for v in chosen if v not in VARIANTS]:
        raise ConfigError(f"unknown --variants {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if min(ranks, width, depth, batch, threads) < 1:
        raise ConfigError("--ranks, --width, --depth, --batch and --threads must each be at least 1")
    if steps < 3 or not 1 <= save_at <= steps:
        # the median leaves out the first step and the save's, so at least one other must remain
        raise ConfigError(f"need --steps >= 3 and 1 <= --save-at <= --steps (got --steps {steps} --save-at {save_at})")
    settings = Settings(ranks=ranks, width=width, depth=depth, batch=batch, steps=steps, save_at=save_at,
                        threads=threads, checkpoint_dir=checkpoint_dir)
    bench_sharded(settings, chosen)


def doctor_command(
    ranks: int = typer.Option(2, "--ranks", help="gloo ranks on this machine, one process each (no Ray)."),
    model: str = typer.Option("resnet18", "--model", help="A built-in model."),
    batch: int = typer.Option(32, "--batch", help="Samples per rank per step."),
    image_size: int = typer.Option(32, "--image-size", help="Input images are this many pixels square."),
    steps: int = typer.Option(20, "--steps", help="Steps of each variant per round."),
    rounds: int = typer.Option(5, "--rounds", help="Rounds; the variants' order alternates."),
    threads: int = typer.Option(1, "--threads", help="torch threads per rank."),
) -> None:
    """What the straggler split (worker/measure/part_clock.py) costs a DDP step when nothing is wrong: the
    same model trained with and without it, in alternating rounds; prints the median steps and the
    difference."""
    from raytrain_ddp.bench.doctor import Settings, bench_doctor
    from raytrain_ddp.worker.models import MODELS

    if model not in MODELS:
        raise ConfigError(f"unknown --model {model!r}; choose from {', '.join(MODELS)}")
    if min(ranks, batch, image_size, steps, rounds, threads) < 1:
        raise ConfigError("--ranks, --batch, --image-size, --steps, --rounds and --threads must each be at least 1")
    bench_doctor(Settings(ranks=ranks, model=model, batch=batch, image_size=image_size, steps=steps, rounds=rounds,
                          threads=threads))
