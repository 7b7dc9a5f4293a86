"""The layout keeps its promises: dependencies run one way, no import cycles, no module imports a
command-line module, every shipped recipe loads, every script answers --help, and every option and recipe
key says what it does."""

import ast
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, env

from gorgon.train.draft import DraftTrainConfig
from gorgon.train.heads import HeadsTrainConfig
from gorgon.train.recipe import load_recipe, print_settings

PACKAGES = {"heads": "gorgon.heads", "decode": "gorgon.decode", "train": "gorgon.train"}
# heads (targets, the drafting methods) <- decode (the method-agnostic decoder) <- train (data, training)
ALLOWED = {"heads": {"heads"}, "decode": {"heads", "decode"}, "train": {"heads", "decode", "train"}}
CLI_MODULES = {"gorgon.heads.cli", "gorgon.heads.export", "gorgon.heads.push", "gorgon.decode.cli"}


def module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    parts = path.relative_to(ROOT / folder).with_suffix("").parts
    name = ".".join((PACKAGES[folder], *parts))
    return name.removesuffix(".__init__")


def imports() -> dict[str, set[str]]:
    """Every gorgon module and the gorgon modules it imports anywhere (function-level imports included)."""
    graph = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = module_name(path)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                    target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                    names = [f"{target}.{a.name}" for a in node.names]
                    found |= {n for n in names if n.startswith("gorgon.")} or {target}
                elif isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
            graph[name] = {m for m in found if m.startswith("gorgon.")}
    # "from .medusa import MedusaDrafter" names an attribute, not a module: keep the longest module prefix.
    for name, targets in graph.items():
        graph[name] = {next(t for t in (m, m.rpartition(".")[0]) if t in graph) for m in targets} - {name}
    return graph


def test_dependencies_run_one_way():
    wrong = [(a, b) for a, bs in imports().items() for b in bs if b.split(".")[1] not in ALLOWED[a.split(".")[1]]]
    assert not wrong


def test_no_import_cycles_even_inside_functions():
    graph = imports()
    done, path = set(), []

    def visit(node):
        if node in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(node):] + [node])}")
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


def test_decoding_reaches_the_drafting_methods_through_the_heads_package_only():
    """decode/ is method-agnostic: it names a method's classes where the options build them (from `gorgon.heads`),
    but nothing in it reaches into a method's folder (a head's layers, a draft's files)."""
    methods = tuple(f"gorgon.heads.methods.{p.name}" for p in (ROOT / "heads" / "methods").iterdir()
                    if (p / "__init__.py").is_file())
    assert "gorgon.heads.methods.eagle" in methods
    assert not [(a, b) for a, bs in imports().items() if a.startswith("gorgon.decode.") for b in bs
                if b.startswith(methods)]


@pytest.mark.slow  # starts a Python process
def test_the_command_starts_before_torch_loads_and_every_export_resolves():
    """`gorgon --help` took a second (gorgon.heads imported torch for its exports), and Ctrl-C in that second
    ended in a traceback: its names now load on first use."""
    code = "import sys, gorgon.heads.cli; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "False", run.stderr
    import gorgon.heads

    for name in gorgon.heads.__all__:
        assert getattr(gorgon.heads, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        gorgon.heads.Nothing  # noqa: B018


def test_nothing_imports_a_command_line_module():
    assert not [(a, b) for a, bs in imports().items() for b in bs if b in CLI_MODULES]


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs").rglob("*.yaml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_recipe_loads(recipe):
    kind = recipe.parent.name
    if kind == "accelerate":
        config = yaml.safe_load(recipe.read_text())
        assert config["distributed_type"] and config["num_processes"] >= 1
        return
    cls = {"heads": HeadsTrainConfig, "draft": DraftTrainConfig}[kind]
    keys = yaml.safe_load(recipe.read_text())
    # Some recipes leave the data and the output folder to the command line, as their headers say.
    load_recipe(cls, str(recipe), {k: "x" for k in ("data", "out") if k not in keys}).check()


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh")))
def test_every_script_answers_help(script):
    cmd = [sys.executable] if script.endswith(".py") else ["bash"]
    run = subprocess.run(cmd + [str(ROOT / "scripts" / script), "--help"], env=env(), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(run.stdout.strip().splitlines()) >= 2


@pytest.mark.slow  # starts a Python process
def test_gpu_check_refuses_an_unknown_step_to_skip_in_one_line():
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env={**env(), "SKIP": "tests,bnch"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""  # refused before any work, on any machine
    assert run.stderr.strip() == ("gpu_check.sh: unknown step 'bnch' in SKIP: use tests, attention, bench, trace, "
                                  "revision or profile")


@pytest.mark.parametrize("module", ["gorgon.train.data", "gorgon.decode.cli", "gorgon.decode.bench",
                                    "gorgon.heads.export", "gorgon.heads.push"])
def test_every_command_option_says_what_it_does(module):
    actions = importlib.import_module(module).parser()._actions
    assert not [a.dest for a in actions if not a.help]


# Scripts an engine's own python runs (scripts/engines.sh builds its venv), where gorgon is not installed.
ENGINE_SIDE = {"engine_vllm.py"}


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("*.py")))
def test_every_script_option_says_what_it_does_and_bad_input_is_one_line(script):
    """Read from the source, without importing torch: each option has a help text, and the script runs through
    run_script, so bad input (--device tpu9, a missing --prompts file) is one line, not a GorgonError traceback."""
    tree = ast.parse((ROOT / "scripts" / script).read_text())
    options = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", None) == "add_argument"]
    assert not [ast.literal_eval(o.args[0]) for o in options if not any(k.arg == "help" for k in o.keywords)]
    entry = next(node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
    assert ("run_script(main" in ast.unparse(entry)) != (script in ENGINE_SIDE)


@pytest.mark.parametrize("cls", [HeadsTrainConfig, DraftTrainConfig])
def test_every_recipe_key_says_what_it_does(cls, capsys):
    assert not [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help")]
    print_settings(cls)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  --learning_rate "))
    assert "peak learning rate" in line and "(default: " in line


@pytest.mark.slow  # starts a Python process
def test_decoding_imports_no_training_stack():
    """`import gorgon.decode` (and the heads, and the options generate and bench share) pulls in torch and
    transformers only: serving does not need trl, datasets, peft, wandb or accelerate."""
    code = ("import sys, gorgon.heads, gorgon.decode, gorgon.decode.options, gorgon.decode.bench; "
            "print(sorted(m for m in ('trl', 'datasets', 'peft', 'wandb', 'accelerate') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[-2000:]


# Core modules that still name a method, and why: the draft model trains through its own script (trl's GKD
# trainer), and --draft and --context-draft build those methods' drafters in the decoding options.
NAMES_A_METHOD = {"gorgon.train.draft": "the draft model's training script",
                  "gorgon.decode.options": "--draft and --context-draft build their methods' drafters"}


def test_the_core_never_names_a_drafting_method():
    """Each method lives in its folder and registers itself (gorgon.heads.methods): no core module imports from a
    method's folder, compares a value with a method's name, or names a method's classes. The registry's list of
    packages and the package's public exports are where methods are named; nowhere else."""
    from gorgon.heads.methods import PACKAGES, methods

    folders = tuple(f"gorgon.heads.methods.{p}" for p in PACKAGES)
    classes = set()
    for m in methods():
        package = importlib.import_module(f"gorgon.heads.methods.{m.name}")
        classes |= {name for name in getattr(package, "__all__", ()) if name[0].isupper()}
    assert {"MedusaHeads", "EagleHead", "MedusaDrafter", "DraftModelDrafter"} <= classes
    exempt = {"gorgon.heads", "gorgon.heads.methods", *NAMES_A_METHOD}
    found = []
    for path in sorted(p for folder in ("heads", "decode", "train") for p in (ROOT / folder).rglob("*.py")):
        name = module_name(path)
        if name.startswith(folders) or name in exempt:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module.startswith(folders) or (node.level and node.module.startswith("methods."))):
                found.append((name, f"imports {node.module}"))
            elif isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in PACKAGES
                                                       for c in (node.left, *node.comparators)):
                found.append((name, ast.unparse(node)))
            elif isinstance(node, (ast.Name, ast.Attribute, ast.alias)) and (
                    getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)) in classes:
                found.append((name, ast.unparse(node) if not isinstance(node, ast.alias) else node.name))
    assert not found
