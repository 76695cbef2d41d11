"""The mesh arguments shared by ``plan``, ``codegen`` and ``demo``."""

from __future__ import annotations

import argparse
from typing import Any

from autopar.mesh import Mesh
from autopar_plans.errors import UsageError
from autopar_plans.mesh import default_axis_names, parse_mesh_shape


def add_mesh_arguments(parser: Any, required: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--mesh", metavar="AxB", help="a logical mesh, such as 8x8 or 64")
    group.add_argument(
        "--cluster",
        metavar="NODESxGPUS",
        help="a cluster: NODES nodes of GPUS devices (outer axis crosses nodes)",
    )
    parser.add_argument("--axes", metavar="NAMES", help="mesh axis names, such as dp,tp")
    parser.add_argument(
        "--device",
        default="h100-sxm",
        help="hardware preset name or file (autopar devices lists them)",
    )


def mesh_from_args(args: argparse.Namespace) -> Mesh:
    names = tuple(args.axes.split(",")) if args.axes else None
    if args.cluster:
        shape = parse_mesh_shape(args.cluster)
        if len(shape) != 2:
            raise UsageError(f"--cluster {args.cluster!r}: write NODESxGPUS, such as 16x8")
        return Mesh.cluster(
            shape[0], shape[1], device=args.device, axis_names=names or ("node", "gpu")
        )
    shape = parse_mesh_shape(args.mesh)
    return Mesh(shape, names or default_axis_names(len(shape)), device=args.device)
