"""Bake every value of every choice, then check, lint and test each baked project."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import venv
from pathlib import Path
from xml.etree import ElementTree

import pytest
import yaml

from .conftest import BIN, COOKIECUTTER_JSON, REPO, bake

# Each value of every choice in cookiecutter.json is baked at least once
# (test_every_choice_value_is_baked keeps it so when a choice grows).
BAKES = {
    "default": {},
    "vision": {
        "project_name": "Vision Lab",
        "package_name": "vision_core",
        "description": "Says \"hi\" \\ and 'bye' & <b>",
        "author_name": "Zoë O'Brien",
        "python_version": "3.10",
        "default_tracker": "none",
        "license": "Apache-2.0",
        "include_slurm": "no",
        "package_manager": "uv",  # tests/test_uv.py installs and runs such a bake with uv
    },
    "speech": {
        "project_name": "Speech-Net 2",
        "python_version": "3.12",
        "scope": "one_node",  # parallel=ddp by default: its smoke test runs 2 CPU processes
        "default_tracker": "tensorboard",
        "license": "BSD-3-Clause",
        "include_slurm": "yes",
    },
    "tabular": {
        "project_name": "Tabular",
        "scope": "multi_node",  # parallel=fsdp by default: 2 CPU processes too
        "default_tracker": "wandb",
        "license": "Proprietary",
    },
    # Differs from the default bake in the default tracker only, which
    # test_choices_land_in_the_project checks: its own tests would run the same
    # code again, so it is baked, checked and linted but not tested.
    "tracked": {"project_name": "Tracked", "default_tracker": "mlflow"},
}
SHARED_ENV_BAKES = [name for name in BAKES if name not in ("default", "tracked")]


# The generated project's docs/ (docs/slurm.md too, with include_slurm=yes): the README
# is the front door and links each of them.
DOCS_PAGES = (
    "checkpoints",
    "configuration",
    "data",
    "debug",
    "deepspeed",
    "development",
    "finetune",
    "gpt",
    "hf",
    "kubernetes",
    "lifecycle",
    "own-model",
    "parallel",
    "preflight",
    "recovery",
    "run-dir",
    "sweeps",
    "text",
    "trackers",
    "trust",
    "updates",
)


def context_of(name: str) -> dict[str, str]:
    """The full context cookiecutter ends up with (choices default to the first value)."""
    ctx = {
        k: (v[0] if isinstance(v, list) else v)
        for k, v in COOKIECUTTER_JSON.items()
        if not k.startswith("_")
    }
    ctx.update(BAKES[name])
    if "project_slug" not in BAKES[name]:
        ctx["project_slug"] = (
            ctx["project_name"].lower().strip().replace(" ", "_").replace("-", "_")
        )
    if "package_name" not in BAKES[name]:
        ctx["package_name"] = ctx["project_slug"]
    return ctx


def default_parallel(ctx: dict[str, str]) -> str:
    """The `parallel` default the scope sets (cookiecutter.json's __default_parallel)."""
    return {"one_device": "none", "one_node": "ddp", "multi_node": "fsdp"}[ctx["scope"]]


def expected_files(ctx: dict[str, str]) -> set[str]:
    pkg = f"src/{ctx['package_name']}"
    files = {
        ".cruft.json",
        ".github/workflows/ci.yml",
        ".gitignore",
        ".pre-commit-config.yaml",
        ".dockerignore",
        "Dockerfile",
        "README.md",
        *(f"docs/{page}.md" for page in DOCS_PAGES),
        "pyproject.toml",
        "scripts/gpu_check.sh",
        "train.py",
        "eval.py",
        "predict.py",
        "generate.py",
        "configs/train.yaml",
        "configs/eval.yaml",
        "configs/predict.yaml",
        "configs/generate.yaml",
        "configs/data/digits.yaml",
        "configs/task/classification.yaml",
        "configs/task/language_model.yaml",
        "configs/callbacks/none.yaml",
        "configs/callbacks/generate_samples.yaml",
        "configs/callbacks/prediction_grid.yaml",
        "configs/experiment/cnn_sgd.yaml",
        "configs/experiment/wide_mlp.yaml",
        "configs/hparams_search/optuna.yaml",
        "configs/hydra/launcher/k8s.yaml",
        "configs/data/tokens.yaml",
        "configs/data/token_file.yaml",
        "configs/data/hf.yaml",
        "configs/data/images.yaml",
        "configs/data/text.yaml",
        "configs/data/chat.yaml",
        "configs/model/hf.yaml",
        "configs/model/cnn.yaml",
        "configs/model/gpt.yaml",
        "configs/model/mlp.yaml",
        "configs/optimizer/adamw.yaml",
        "configs/optimizer/sgd.yaml",
        "configs/scheduler/constant.yaml",
        "configs/scheduler/plateau.yaml",
        "configs/scheduler/warmup_cosine.yaml",
        f"{pkg}/__init__.py",
        f"{pkg}/contract.py",
        f"{pkg}/callbacks/__init__.py",
        f"{pkg}/callbacks/samples.py",
        f"{pkg}/callbacks/images.py",
        f"{pkg}/tasks/__init__.py",
        f"{pkg}/tasks/classification.py",
        f"{pkg}/tasks/language_model.py",
        f"{pkg}/models/__init__.py",
        f"{pkg}/models/digits.py",
        f"{pkg}/models/gpt.py",
        f"{pkg}/models/hf.py",
        f"{pkg}/data/__init__.py",
        f"{pkg}/data/digits.py",
        f"{pkg}/data/tokens.py",
        f"{pkg}/data/hf.py",
        f"{pkg}/data/images.py",
        f"{pkg}/data/text.py",
        f"{pkg}/data/chat.py",
        f"{pkg}/data/assets/chat_arithmetic.jsonl",
        f"{pkg}/data/assets/digits.csv.gz",
        f"{pkg}/data/assets/digits.parquet",
        f"{pkg}/data/assets/tokens_train.bin",
        f"{pkg}/data/assets/tokens_train.json",
        f"{pkg}/data/assets/tokens_val.bin",
        f"{pkg}/data/assets/tokens_val.json",
        "tests/__init__.py",
        "tests/conftest.py",
        "tests/test_configs.py",
        "tests/test_recipe.py",
        "tests/test_images.py",
        "tests/test_text_formats.py",
        "tests/test_moe.py",
        "tests/test_chat.py",
        "tests/test_packing.py",
    }
    if ctx["license"] != "Proprietary":
        files.add("LICENSE")
    if ctx["include_slurm"] == "yes":
        files |= {
            "configs/hydra/launcher/slurm.yaml",
            "docs/slurm.md",
        }
    return files


@pytest.fixture(scope="session")
def baked(template_url, cookiecutter_config, tmp_path_factory) -> dict[str, Path]:
    """Every bake of BAKES, baked once per session from the git URL."""
    projects = {}
    for name, extra in BAKES.items():
        out = tmp_path_factory.mktemp(f"bake-{name}")
        proc = bake(template_url, cookiecutter_config, out, **extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Next steps" in proc.stdout
        (project,) = out.iterdir()
        (out / "bake.stdout").write_text(proc.stdout)  # beside the project, not in it
        projects[name] = project
    return projects


def project_files(project: Path) -> set[str]:
    return {p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file()}


def test_every_choice_value_is_baked():
    for key, values in COOKIECUTTER_JSON.items():
        if isinstance(values, list) and not key.startswith("_"):
            baked_values = {context_of(name)[key] for name in BAKES}
            assert baked_values == set(values), f"{key}: {set(values) - baked_values} never baked"


@pytest.mark.parametrize("name", BAKES)
def test_exact_file_set(baked, name):
    ctx = context_of(name)
    assert baked[name].name == ctx["project_slug"]
    assert project_files(baked[name]) == expected_files(ctx)


@pytest.mark.parametrize("name", BAKES)
def test_no_template_leftovers(baked, name):
    for rel in project_files(baked[name]):
        if rel.endswith((".gz", ".bin", ".parquet")):  # data, copied without rendering
            continue
        text = (baked[name] / rel).read_text(encoding="utf-8")
        if rel.startswith(".github/"):
            text = text.replace("${{", "")  # GitHub Actions expressions are meant to stay
        assert "{{" not in text and "{%" not in text, rel
        if rel != ".cruft.json":  # cruft's format names the cookiecutter context
            assert "cookiecutter" not in text.lower(), rel


@pytest.mark.parametrize("name", BAKES)
def test_choices_land_in_the_project(baked, name):
    ctx, project = context_of(name), baked[name]
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["name"] == ctx["project_slug"]
    assert meta["description"] == ctx["description"]  # quotes and backslashes survive
    assert meta["authors"] == [{"name": ctx["author_name"], "email": ctx["author_email"]}]
    assert meta["requires-python"] == f">={ctx['python_version']}"
    assert meta.get("license") == (None if ctx["license"] == "Proprietary" else ctx["license"])
    assert ("slurm" in meta["optional-dependencies"]) == (ctx["include_slurm"] == "yes")
    assert_package_manager(ctx, tomllib.loads((project / "pyproject.toml").read_text()), project)
    defaults = yaml.safe_load((project / "configs/train.yaml").read_text())["defaults"]
    assert {"tracker": ctx["default_tracker"]} in defaults
    assert {"parallel": default_parallel(ctx)} in defaults
    cruft_answers = json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]
    assert {k: cruft_answers[k] for k in ctx} == ctx  # what cruft update bakes again with
    workflow = yaml.safe_load((project / ".github/workflows/ci.yml").read_text())
    setup = next(
        s for s in workflow["jobs"]["test"]["steps"] if "setup-python" in s.get("uses", "")
    )
    assert setup["with"]["python-version"] == ctx["python_version"]
    if ctx["license"] != "Proprietary":
        first_line = (project / "LICENSE").read_text().lstrip().splitlines()[0]
        expected = {
            "MIT": "MIT License",
            "BSD-3-Clause": "BSD 3-Clause License",
            "Apache-2.0": "Apache License",
        }[ctx["license"]]
        assert first_line.strip() == expected


def assert_package_manager(ctx: dict[str, str], pyproject: dict, project: Path) -> None:
    """uv: torch by extra from PyTorch's explicit indexes (uv's PyTorch guide), the
    dev tools in a dependency group, CI through uv. pip: none of it."""
    extras = pyproject["project"]["optional-dependencies"]
    workflow = (project / ".github/workflows/ci.yml").read_text()
    builds = ["cpu", "cu128", "cu130"]
    if ctx["package_manager"] == "pip":
        assert "uv" not in pyproject.get("tool", {}) and "dependency-groups" not in pyproject
        assert "dev" in extras and not set(builds) & set(extras)
        assert "pip install -e '.[dev" in workflow and "uv " not in workflow
        return
    uv = pyproject["tool"]["uv"]
    assert {i["name"]: (i["url"], i["explicit"]) for i in uv["index"]} == {
        f"pytorch-{b}": (f"https://download.pytorch.org/whl/{b}", True) for b in builds
    }
    assert uv["sources"]["torch"] == [{"index": f"pytorch-{b}", "extra": b} for b in builds]
    assert uv["conflicts"] == [[{"extra": b} for b in builds]]
    assert all(extras[b] == ["torch==2.13.0"] for b in builds) and "dev" not in extras
    assert any(d.startswith("pytest") for d in pyproject["dependency-groups"]["dev"])
    assert "uv sync" in workflow and "uv run pytest" in workflow


@pytest.mark.parametrize("name", BAKES)
def test_readme_names_the_chosen_defaults(baked, name):
    """The README and the docs pages say what this bake chose, and the README installs
    as the post-gen message says."""
    ctx, readme = context_of(name), (baked[name] / "README.md").read_text()
    docs = {p.stem: p.read_text() for p in (baked[name] / "docs").glob("*.md")}
    tracker, parallel = ctx["default_tracker"], default_parallel(ctx)
    assert f"The default is `tracker={tracker}`" in docs["trackers"]
    assert f"`none` (default: `{tracker}`)" in docs["configuration"]  # the tracker row
    assert f"The default is `parallel={parallel}`" in docs["parallel"]
    assert f"`deepspeed` (default: `{parallel}`)" in docs["configuration"]
    # The scope's paragraph comes first: in the README's "Set up and run".
    opening = readme.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    for scope in COOKIECUTTER_JSON["scope"]:
        assert (f"(scope `{scope}`)" in opening) == (scope == ctx["scope"]), scope
    if ctx["scope"] == "multi_node":
        assert "parallel.num_nodes=2 parallel.node_rank=R" in opening
        assert ("hydra/launcher=slurm" in opening) == (ctx["include_slurm"] == "yes")
    for text in [readme, *docs.values()]:
        for other in set(COOKIECUTTER_JSON["default_tracker"]) - {tracker}:
            assert f"`tracker={other}` (the default)" not in text
            assert f"The default is `tracker={other}`" not in text
    printed = (baked[name].parent / "bake.stdout").read_text()
    steps = printed.split("Next steps:\n", 1)[1].strip().splitlines()
    assert steps[0].strip() == f"cd {ctx['project_slug']}"
    setup = readme.split("## Set up and run", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    assert [line.strip() for line in steps[1:]] == setup.strip().splitlines()
    assert "Installing torch" in readme
    if ctx["package_manager"] == "uv":  # the two commands, and the tests through uv
        commands = [line.split("#")[0].strip() for line in setup.strip().splitlines()]
        assert commands == ["uv sync --extra cpu", "uv run train.py", "uv run pytest -n auto"]
    else:
        assert "pip install torch==" in setup and "uv " not in setup


README_MAX_LINES = 300  # the front door: set-up, the commands, the layout, links
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def without_code(markdown: str) -> str:
    """The text outside fenced code blocks (a link in code is code)."""
    return re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", markdown, flags=re.M | re.S)


def heading_ids(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, every character but
    letters, digits, spaces, '-' and '_' dropped, spaces made '-'; a repeated one -1, -2."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    for title in re.findall(r"^#{1,6} +(.+?) *#*$", without_code(markdown), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        ids.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return ids


@pytest.mark.parametrize("name", BAKES)
def test_readme_is_the_front_door_and_every_docs_link_resolves(baked, name):
    """At most README_MAX_LINES lines, a link to every docs/ page, and every relative
    link in README.md and docs/*.md names a file of the bake (and a heading on it)."""
    project = baked[name]
    readme = (project / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, len(readme.splitlines())
    pages = [project / "README.md", *sorted((project / "docs").glob("*.md"))]
    from_readme = set()
    for page in pages:
        for target in MARKDOWN_LINK.findall(without_code(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(project)}: ({target})"
            rel = file.relative_to(project).as_posix()  # never outside the project
            if page.name == "README.md":
                from_readme.add(rel)
            assert file.is_file(), f"{where} names no file"
            if anchor:
                assert anchor in heading_ids(file.read_text()), f"{where}: no such heading"
    docs = {p.relative_to(project).as_posix() for p in pages[1:]}
    assert docs <= from_readme, f"not linked from README.md: {sorted(docs - from_readme)}"


@pytest.mark.parametrize("name", BAKES)
def test_baked_project_lints(baked, name):
    ruff = str(BIN / "ruff")
    for cmd in ([ruff, "check", "."], [ruff, "format", "--check", "."]):
        proc = subprocess.run(cmd, cwd=baked[name], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def run_pytest(
    python: str, project: Path, *args: str, env: dict | None = None, log: Path | None = None
) -> str:
    """pytest in a baked project; its output, also written to ``log`` as it runs
    (a long suite can be followed with ``tail -f`` and is on disk if it hangs)."""
    log = log or project.parent / "pytest.log"
    with log.open("w") as out_file:
        proc = subprocess.run(
            [
                python,
                "-m",
                "pytest",
                *([] if "-v" in args else ["-q"]),
                "-p",
                "no:cacheprovider",
                *args,
            ],
            cwd=project,
            stdout=out_file,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            timeout=4200,  # the default bake's suite: ~50 min on 2 cores (CI's limit: 90)
        )
    out = log.read_text()
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and " failed" not in out
    return out


@pytest.mark.parametrize("name", SHARED_ENV_BAKES)
def test_baked_project_tests_pass_in_shared_env(baked, name):
    """The other bakes share this environment and the engine (installed editable from
    training_engine/). They differ from the default bake in names, defaults and
    optional files, not in engine code: each runs its own tests (every option
    composes and builds; the bake's own defaults train; kill -9 and resume are bit
    for bit). The engine's tests run once, on the default bake, which keeps CI in
    budget."""
    # No tracker packages here (the default bake's venv has them): their tests skip.
    env = {**os.environ, "PYTHONPATH": str(baked[name] / "src"), "TESTS_SKIP_MISSING_EXTRAS": "1"}
    # -n auto: one worker per core, as the project README says
    run_pytest(sys.executable, baked[name], "-n", "auto", "tests", env=env)


@pytest.mark.slow
def test_default_bake_installs_and_passes_in_a_fresh_venv(baked, tmp_path):
    """From nothing: a missing dependency in pyproject.toml fails here."""
    project = baked["default"]
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def pip(*args: str, env: dict | None = None) -> None:
        proc = subprocess.run(
            [py, "-m", "pip", "install", "-q", *args],
            cwd=project,
            capture_output=True,
            text=True,
            env={**clean_env, **(env or {})},
            timeout=1200,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    pip("torch==2.13.0")  # the CPU wheel first, as the project README says
    pip("-e", ".[dev,slurm,optuna]")  # dev brings the tracker extras: tensorboard, wandb, mlflow
    # The deepspeed extra, as the project README says for a machine without CUDA.
    pip("--no-build-isolation", "deepspeed>=0.15", "transformers>=4.40", env={"DS_BUILD_OPS": "0"})
    # Everything but the slow tests, except those marked ci (fault injection, the
    # accuracy run, 20 DDP teardowns, DeepSpeed ZeRO-2): the rest of the slow ones
    # (same seed 10x under load, SIGUSR1, a compiled GPT, a SLURM time limit, more
    # resume cases) are `pytest -m slow`. Every test's duration is in the log.
    (REPO / "build").mkdir(exist_ok=True)
    junit = REPO / "build" / "default-bake-junit.xml"
    # -v: the log says which test runs, while it runs; -n auto: as the project README says
    selection = ["-m", "not slow or ci", "-n", "auto", "-v", "--durations=0"]
    selection.append(f"--junitxml={junit}")
    # And the template's bench (bench/, not part of the project) on this bake, in the
    # same run and pool of workers (no time of its own): its quick mode and its turns.
    # The project's own tests, the engine's (run once, here) and the bench; -c: the
    # project's pytest config (markers, options) for the three folders.
    engine_tests = REPO / "training_engine" / "engine_tests"
    selection += ["-c", "pyproject.toml", "tests", str(engine_tests), str(REPO / "bench")]
    log = REPO / "build" / "default-bake-pytest.log"
    run_pytest(py, project, *selection, env={**clean_env, "BENCH_PROJECT": str(project)}, log=log)
    # The accuracy run and the bench ran and passed: not skipped, not deselected (read
    # from the report, not the text, which names every test in its durations).
    cases = {c.get("name"): c for c in ElementTree.parse(junit).iter("testcase")}
    for name in (
        "test_default_run_reaches_95_percent",
        "test_bench_quick_mode_reports_every_figure",
    ):
        outcome = [
            child.tag for child in cases[name] if child.tag in ("skipped", "failure", "error")
        ]
        assert not outcome, (name, outcome)


def readme_checklist_files(page: str) -> dict[str, str]:
    """The files the "Add your own model and data" checklist (docs/own-model.md) tells
    a user to write: each numbered item names a path in backticks and gives its content
    in the code block that follows."""
    section = page.split("## Add your own model and data", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"`((?:src|configs)/[^`]+\.(?:py|yaml))`.*?```\w*\n(.*?)```", section, re.S)
    return {path: textwrap.dedent(body) for path, body in found}


def test_own_model_and_data_as_the_readme_says_pass_the_projects_tests(baked, tmp_path):
    """A fresh project plus the checklist's 2 code files and 2 YAML files (and
    its optional experiment), and not one edit elsewhere: the project's config tests
    (which find every option) and its experiment test pass with the new files in
    them, and train.py trains on them."""
    project = tmp_path / "project"
    shutil.copytree(baked["default"], project)
    files = readme_checklist_files((project / "docs" / "own-model.md").read_text())
    pkg = context_of("default")["package_name"]
    assert sorted(files) == sorted(
        [
            f"src/{pkg}/data/blobs.py",
            "configs/data/blobs.yaml",
            f"src/{pkg}/models/tiny.py",
            "configs/model/tiny.yaml",
            "configs/experiment/blobs.yaml",  # optional: a bundle that sets trainer.max_steps
        ]
    )
    for path, body in files.items():
        assert not (project / path).exists()  # new files only
        (project / path).write_text(body)
    env = {**os.environ, "PYTHONPATH": str(project / "src"), "TESTS_SKIP_MISSING_EXTRAS": "1"}
    out = run_pytest(
        sys.executable,
        project,
        "-m",
        "not slow and not multiprocess",
        "tests/test_configs.py",
        "-v",
        env=env,
    )
    for option in ("model=tiny", "data=blobs", "experiment=blobs"):
        assert f"test_option_composes_and_instantiates[{option}] PASSED" in out
    train = subprocess.run(
        [
            sys.executable,
            "train.py",
            "model=tiny",
            "data=blobs",
            "parallel=none",
            "tracker=csv",
            "preflight=off",
            "trainer.max_epochs=3",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metrics"]["val/acc"] > 0.8  # 3 well-separated blobs: chance is 1/3
    # An HF-style output (.logits) and the model option's own monitor: judged on val/loss
    assert summary["best"]["name"] == "val/loss" and summary["best"]["value"] < 0.5
    # task.py's hooks on the user's model: loss's logs averaged per log window
    # (train/acc), evaluate through loss (val/loss above), param_groups' default (the
    # optimizer's weight decay on the 2 weight matrices, none on the 2 biases)
    assert 0.8 < summary["metrics"]["train/acc"] <= 1.0
    import torch

    (last,) = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1:]
    groups = torch.load(last / "optimizer.pt", weights_only=True)["param_groups"]
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(2, 0.01), (2, 0.0)]
