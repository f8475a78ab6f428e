#!/usr/bin/env python3
"""Write the rules, PrometheusRule, Grafana dashboard and Kubernetes examples for a metric namespace.

    python config/generate.py                      # the committed files (namespace "sglang_") and README's block
    python config/generate.py --check              # write nothing; exit 1 naming each stale file
    python config/generate.py --namespace sglang: --output-dir out/   # the same set for the engine's names
    python config/generate.py --profiles "" --output-dir out/         # the default profile alone

The files for the default namespace are committed under config/ (prometheus/, k8s/, grafana/);
another namespace is written to --output-dir with the same layout. The rules and the dashboard
cover every profile in use: the default one (sglang, or --catalog) and --profiles (default: every
other packaged profile, lmcache), each under its own namespace. Run from the repository root
with the project installed (it reads the packaged catalog); needs only PyYAML besides.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

CONFIG = Path(__file__).resolve().parent
ROOT = CONFIG.parent
if str(ROOT) not in sys.path:  # run as a script: the repository root holds `config.generator` and `exporter`
    sys.path.insert(0, str(ROOT))

from config.generator import DEFAULT_NAMESPACE, other_profiles, outputs, with_readme_block  # noqa: E402
from exporter.catalog import load_profiles  # noqa: E402
from exporter.errors import ConfigError  # noqa: E402

README = ROOT / "README.md"


def planned(namespace: str, output_dir: Path, catalog: Path | None, profiles: list[str]) -> dict[Path, str]:
    """Every file this run writes, with its text; README's block only for the committed set."""
    files = {output_dir / rel: text for rel, text in outputs(namespace, load_profiles(catalog, profiles)).items()}
    if output_dir.resolve() == CONFIG and namespace == DEFAULT_NAMESPACE and catalog is None:
        files[README] = with_readme_block(README.read_text(encoding="utf-8"), namespace)
    return files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                        help=f"the sidecar's metrics.namespace (default {DEFAULT_NAMESPACE!r}; 'sglang:' for the engine's names)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where to write (default: config/, only for the default namespace)")
    parser.add_argument("--catalog", type=Path, default=None,
                        help="a catalog YAML (the sidecar's metrics.catalog); default: the packaged one")
    parser.add_argument("--profiles", default=",".join(other_profiles()),
                        help="the profiles in use besides the default one, comma-separated: packaged names or "
                             f"profile YAML files (the sidecar's metrics.profiles; default {','.join(other_profiles())!r})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a file differs from what would be written")
    args = parser.parse_args(argv)
    profiles = [name for name in args.profiles.split(",") if name]
    output_dir = args.output_dir
    if output_dir is None:
        if args.namespace != DEFAULT_NAMESPACE or args.catalog is not None or profiles != other_profiles():
            # The committed files are the default set; another set must not overwrite them.
            parser.error("--namespace, --catalog and --profiles other than the defaults need --output-dir")
        output_dir = CONFIG
    try:
        files = planned(args.namespace, output_dir, args.catalog, profiles)
    except (ValueError, ConfigError, OSError) as err:
        print(f"generate: error: {err}", file=sys.stderr)
        return 2
    if args.check:
        stale = [path for path, text in files.items()
                 if not path.is_file() or path.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"{path} is out of date: run python config/generate.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
