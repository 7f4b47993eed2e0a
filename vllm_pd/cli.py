"""The ``vllm-pd`` command line: one dispatcher, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``
and keeps heavy imports (vLLM, torch) inside ``run`` so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("vllm_pd.small_model.command", "write a small random-weight HF model folder"),
    "store-master": ("vllm_pd.connector.store.master_command", "run the KV store's cluster-wide index"),
    "proxy": ("vllm_pd.router.cli.command_proxy", "run the prefill/decode proxy in front of vLLM instances"),
    "up": ("vllm_pd.router.cli.command_up", "start prefill and decode vLLM servers plus the proxy on this machine"),
    "profile": ("vllm_pd.planner.profile_command", "measure a running vLLM instance's latencies into a profile file"),
    "plan": ("vllm_pd.planner.plan_command", "simulate colocated and PD deployments and pick the best under SLOs"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-pd", description="prefill/decode disaggregation for vLLM")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
