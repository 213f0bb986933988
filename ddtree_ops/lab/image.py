"""The lab's base image: a debootstrap Debian bookworm root with systemd, sshd and the SGLang venv.

Built once into `<cache>/base-<recipe hash>` (≈ 6 GB, almost all of it the venv), with
`<cache>/base` pointing at the current one. Hosts boot from it read-only through their own
overlay, so a rebuild happens only when the recipe below changes (bump RECIPE_VERSION when the
build logic changes in a way the lists do not show).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from ddtree_ops.lab.config import DEFAULT_SGLANG, SGLANG_VENVS, VENV_DIR, LabPaths
from ddtree_ops.lab.steps import LabError, Progress, no_progress, run_step

RECIPE_VERSION = 1
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"

# Packages this machine (the control side) needs for the lab, for the install script to apt-get.
CONTROL_APT_PACKAGES = (
    "systemd-container",  # systemd-nspawn
    "debootstrap",
    "debian-archive-keyring",  # debootstrap verifies the bookworm Release file with it
    "iproute2",  # ip: the bridge
    "util-linux",  # unshare, mount: each host's overlay lives in its own mount namespace
    "openssh-client",  # ssh, ssh-keygen: keys, readiness checks, tests
    "python3-pip",  # pip download of the venv's wheels when the control venv has no pip
    "ca-certificates",
)

# Debian packages inside each host.
IMAGE_APT_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-venv",
    "iproute2",
    "iputils-ping",
    "ca-certificates",
    "sudo",
    "procps",
    "less",
)

SGLANG_REQUIREMENT = f"sglang=={DEFAULT_SGLANG}"
# Each further SGLang the image carries (config.SGLANG_VENVS), as what its venv holds besides the default
# venv's packages, all --no-deps. Every other package is the default venv's own file, hard-linked (the
# image is one filesystem), so a second SGLang costs its own wheel, not another 6 GB. 0.5.23 pins the same
# torch 2.14.1 the default venv has; its argument resolution also imports tvm_ffi (measured: importing
# server_args and parsing DFLASH flags needs nothing else).
OVERLAY_VENVS: dict[str, tuple[str, ...]] = {
    "0.5.23": ("sglang==0.5.23", "apache-tvm-ffi==0.1.11"),
}
# What `sglang.srt.server_args` needs to import and parse on CPU; sglang itself goes in with
# --no-deps because its full dependency set pulls GPU-only packages. torch/torchvision/triton are
# the CUDA builds, which import and run on CPU (the CPU-only torch 2.13 has no matching torchvision,
# and sglang imports torchvision.io unconditionally).
VENV_REQUIREMENTS = (
    "torch==2.14.1",
    "torchvision==0.29.1",
    "triton==3.8.0",
    "transformers==5.8.1",
    "numpy",
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "packaging",
    "pillow",
    "starlette",
    "tqdm",
    "IPython",
    "pydantic",
    "aiohttp",
    "pyzmq",
    "openai",
    "partial_json_parser",
    "dill",
    "sentencepiece",
    "msgspec",
    # Imported on the way to ModelConfig, which ServerArgs loads while parsing (measured: without
    # them prepare_server_args fails with ModuleNotFoundError).
    "einops",
    "compressed-tensors",
    "gguf",
    # The serving path the payload patches (scheduler → dflash_worker) imports these; with them
    # `smoke` imports the patched worker itself instead of warning that it could not.
    "loguru",
    "setproctitle",
    "uvicorn",
    "fastapi",
    "opentelemetry-api",
    # /metrics: SGLang's own collectors and the payload's auto figures (ddtree_metrics) register here.
    "prometheus-client",
)

# Parsed inside the image once at build time, so a broken venv fails the build, not a test later;
# the lab tests run the same script on a booted host and check its JSON line.
# ServerArgs always loads the model's config (piecewise-CUDA-graph check), so the smoke gives it a
# tiny local Llama config; a model path that does not exist fails with a Hub repo-id error.
SERVER_ARGS_SMOKE = """\
import json, pathlib, tempfile, sglang
from sglang.srt.server_args import prepare_server_args
model = pathlib.Path(tempfile.mkdtemp()) / "tiny-llama"
model.mkdir()
(model / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "torch_dtype": "float32"}))
args = prepare_server_args(["--model-path", str(model), "--device", "cpu",
    "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(model),
    "--speculative-num-draft-tokens", "16"])
print(json.dumps({"version": sglang.__version__, "algorithm": str(args.speculative_algorithm),
                  "draft": args.speculative_draft_model_path == str(model),
                  "draft_tokens": args.speculative_num_draft_tokens}))
"""

SSHD_CONFIG = """\
# ddtree-ops lab: key-only root login; each host's own ed25519 key is written at host creation.
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
"""

# Host-specific files (address, host key, authorized_keys) live in each host's overlay; the base
# only carries what is the same everywhere.
JOURNALD_CONFIG = """\
[Journal]
Storage=volatile
RuntimeMaxUse=32M
"""


def required_apt_packages() -> list[str]:
    """apt packages this machine needs to build and run the lab (the install script apt-gets them)."""
    return list(CONTROL_APT_PACKAGES)


def debian_mirror() -> str:
    return os.environ.get("DDTREE_LAB_DEBIAN_MIRROR", DEFAULT_MIRROR)


def recipe() -> dict[str, object]:
    return {
        "version": RECIPE_VERSION,
        "suite": SUITE,
        "apt": list(IMAGE_APT_PACKAGES),
        "venv_dir": VENV_DIR,
        "venv": list(VENV_REQUIREMENTS),
        "sglang": SGLANG_REQUIREMENT,
        "overlay_venvs": {v: {"dir": SGLANG_VENVS[v], "requirements": list(r)} for v, r in OVERLAY_VENVS.items()},
        "sshd": SSHD_CONFIG,
        "journald": JOURNALD_CONFIG,
    }


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:16]


def image_dir(paths: LabPaths) -> Path:
    return paths.cache / f"base-{recipe_hash()}"


def is_built(paths: LabPaths) -> bool:
    return (image_dir(paths) / "rootfs" / "etc" / "ddtree-ops-lab-image").is_file()


def ensure_base_image(paths: LabPaths, progress: Progress = no_progress) -> Path:
    """Return the root directory of the current base image, building it first if its recipe changed."""
    target = image_dir(paths)
    rootfs = target / "rootfs"
    if is_built(paths):
        _point_base_link(paths, target)
        return rootfs
    paths.cache.mkdir(parents=True, exist_ok=True)
    build = paths.cache / f"build-{recipe_hash()}"
    if build.exists():
        progress("removing an unfinished earlier build")
        shutil.rmtree(build)
    build.mkdir()
    log = paths.logs / f"build-{recipe_hash()}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    started = time.monotonic()
    progress(f"building base image {recipe_hash()} (a few minutes, once); log: {log}")
    wheelhouse = build / "wheelhouse"
    # debootstrap is network- and dpkg-bound, pip download disk-bound: run them side by side.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        wheels = pool.submit(
            _download_wheels, wheelhouse, paths.logs / f"wheels-{recipe_hash()}.log", progress
        )
        _debootstrap(build / "rootfs", log, progress)
        wheels.result()
    _configure(build / "rootfs", log, progress)
    _install_venv(build / "rootfs", wheelhouse, log, progress)
    for version, requirements in OVERLAY_VENVS.items():
        _install_overlay_venv(build / "rootfs", wheelhouse, version, requirements, log, progress)
    progress("base image: cleaning up")
    shutil.rmtree(wheelhouse)  # ~3 GB; re-fetched (from the local mirror) only on a recipe change
    (build / "rootfs" / "etc" / "ddtree-ops-lab-image").write_text(
        json.dumps({"recipe_hash": recipe_hash(), "recipe": recipe(), "built": time.time()}, indent=1) + "\n"
    )
    os.replace(build, target)
    _point_base_link(paths, target)
    progress(f"base image ready in {time.monotonic() - started:.0f} s: {target}")
    return rootfs


def prune_old_images(paths: LabPaths, in_use: set[Path]) -> None:
    """Delete base images of older recipes that no host boots from."""
    current = image_dir(paths)
    for old in paths.cache.glob("base-*"):
        if old != current and old.resolve() not in in_use and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _point_base_link(paths: LabPaths, target: Path) -> None:
    link = paths.base_link
    if link.is_symlink() and Path(os.readlink(link)) == Path(target.name):
        return
    tmp = paths.cache / "base.new"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    os.replace(tmp, link)


def _pip_for_download() -> list[str]:
    # The control venv normally has pip; a uv-made venv may not, so fall back to Debian's python3.
    for python in (sys.executable, "/usr/bin/python3"):
        if Path(python).exists() and _has_pip(python):
            return [python, "-m", "pip"]
    raise LabError("no pip found to download the lab's wheels: apt-get install python3-pip")


def _has_pip(python: str) -> bool:
    from ddtree_ops.lab.steps import capture

    return capture([python, "-m", "pip", "--version"]).returncode == 0


def _download_wheels(wheelhouse: Path, log: Path, progress: Progress) -> None:
    # Downloaded on this machine, which has the pip configuration (local mirror or PyPI); the image
    # then installs offline from the wheelhouse. Both sides are CPython 3.11 on x86_64 glibc 2.36.
    progress("base image: downloading the venv's wheels (torch, transformers, sglang, …)")
    log.write_text("")
    pip = _pip_for_download()
    run_step(
        "pip download (venv requirements)", [*pip, "download", "--dest", wheelhouse, *VENV_REQUIREMENTS], log
    )
    run_step(
        "pip download (sglang, --no-deps)",
        [*pip, "download", "--no-deps", "--dest", wheelhouse, SGLANG_REQUIREMENT],
        log,
    )
    for version, requirements in OVERLAY_VENVS.items():
        run_step(f"pip download (the SGLang {version} venv, --no-deps)",
                 [*pip, "download", "--no-deps", "--dest", wheelhouse, *requirements], log)


def _debootstrap(rootfs: Path, log: Path, progress: Progress) -> None:
    progress(f"base image: debootstrap {SUITE} from {debian_mirror()} (≈ 2 min)")
    run_step(
        f"debootstrap {SUITE}",
        [
            "debootstrap",
            "--variant=minbase",
            "--include=" + ",".join(IMAGE_APT_PACKAGES),
            SUITE,
            rootfs,
            debian_mirror(),
        ],
        log,
        timeout=1800,
    )


def nspawn_oneshot(rootfs: Path, *command: str, binds: tuple[tuple[Path, str], ...] = ()) -> list[str]:
    """argv of a one-shot command inside the (not booted) image, with no network."""
    argv = [
        "systemd-nspawn",
        "--quiet",
        "--register=no",
        "--keep-unit",
        "--private-network",
        "--link-journal=no",
        "--directory",
        str(rootfs),
        "--setenv=PIP_NO_CACHE_DIR=1",
        "--setenv=PIP_DISABLE_PIP_VERSION_CHECK=1",
    ]
    argv += [f"--bind-ro={src}:{dst}" for src, dst in binds]
    return [*argv, "--", *command]


def _configure(rootfs: Path, log: Path, progress: Progress) -> None:
    progress("base image: configuring systemd, sshd and networking")
    sshd_dir = rootfs / "etc/ssh/sshd_config.d"
    sshd_dir.mkdir(parents=True, exist_ok=True)
    (sshd_dir / "ddtree-lab.conf").write_text(SSHD_CONFIG)
    # Host keys are per host and generated at host creation; one baked into the image would be shared.
    for key in (rootfs / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    journald = rootfs / "etc/systemd/journald.conf.d"
    journald.mkdir(parents=True, exist_ok=True)
    (journald / "ddtree-lab.conf").write_text(JOURNALD_CONFIG)
    # An empty machine-id makes systemd generate one per boot, so hosts do not share one.
    (rootfs / "etc/machine-id").write_text("")
    (rootfs / "etc/hostname").unlink(missing_ok=True)
    run_step(
        "enable systemd-networkd and ssh in the image",
        nspawn_oneshot(rootfs, "systemctl", "enable", "systemd-networkd.service", "ssh.service"),
        log,
    )
    # Nothing on these hosts should wait for a network that is configured statically.
    run_step(
        "mask units a container does not need",
        nspawn_oneshot(
            rootfs,
            "systemctl",
            "mask",
            "systemd-networkd-wait-online.service",
            "apt-daily.timer",
            "apt-daily-upgrade.timer",
            "e2scrub_all.timer",
            "fstrim.timer",
        ),
        log,
    )
    run_step("apt-get clean", nspawn_oneshot(rootfs, "apt-get", "clean"), log)
    shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
    (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)


def _install_venv(rootfs: Path, wheelhouse: Path, log: Path, progress: Progress) -> None:
    python = f"{VENV_DIR}/bin/python"
    binds = ((wheelhouse, "/wheelhouse"),)
    progress(f"base image: creating {VENV_DIR}")
    run_step("python3 -m venv", nspawn_oneshot(rootfs, "/usr/bin/python3", "-m", "venv", VENV_DIR), log)
    def pip_install(step: str, *args: str, timeout: float) -> None:
        # Offline from the wheelhouse the host side filled: the image build never reaches an index.
        argv = nspawn_oneshot(rootfs, python, "-m", "pip", "install", "--no-index", "--find-links", "/wheelhouse",
                              *args, binds=binds)
        run_step(step, argv, log, timeout=timeout)

    progress("base image: installing torch, transformers and friends into the venv (offline, ≈ 3 min)")
    pip_install("pip install (venv requirements)", *VENV_REQUIREMENTS, timeout=3600)
    progress(f"base image: installing {SGLANG_REQUIREMENT} (--no-deps)")
    pip_install("pip install sglang --no-deps", "--no-deps", SGLANG_REQUIREMENT, timeout=1800)
    _server_args_smoke(rootfs, python, DEFAULT_SGLANG, log, progress)
    # The lock of what was actually installed, for anyone asking "which transformers is on lab-2?".
    lock = rootfs / VENV_DIR.lstrip("/") / "requirements.lock"
    _freeze(rootfs, python, lock, log)


def _install_overlay_venv(rootfs: Path, wheelhouse: Path, version: str, requirements: tuple[str, ...],
                          log: Path, progress: Progress) -> None:
    """A venv for another SGLang: the default venv's packages hard-linked in, then its own on top (--no-deps)."""
    venv = SGLANG_VENVS[version]
    python = f"{venv}/bin/python"
    progress(f"base image: creating {venv} (SGLang {version}, sharing the default venv's packages)")
    run_step(f"python3 -m venv {venv}", nspawn_oneshot(rootfs, "/usr/bin/python3", "-m", "venv", venv), log)
    src, dst = (_site_packages(rootfs, d) for d in (VENV_DIR, venv))
    # The default SGLang stays out (its own is installed below); what the fresh venv already has (pip,
    # setuptools) is its own copy, so pip never rewrites a shared file here. On a host the image is the
    # overlay's read-only lower layer: a write there copies the file up first, so it never reaches the
    # other venv's link.
    shared = [e for e in sorted(src.iterdir()) if not _is_sglang(e.name) and not (dst / e.name).exists()]
    run_step(f"hard-link the default venv's packages into {venv}", ["cp", "-al", "--", *shared, dst], log)
    argv = nspawn_oneshot(rootfs, python, "-m", "pip", "install", "--no-index", "--find-links", "/wheelhouse",
                          "--no-deps", *requirements, binds=((wheelhouse, "/wheelhouse"),))
    progress(f"base image: installing {', '.join(requirements)} into {venv} (--no-deps)")
    run_step(f"pip install (the SGLang {version} venv)", argv, log, timeout=1800)
    _server_args_smoke(rootfs, python, version, log, progress)
    _freeze(rootfs, python, rootfs / venv.lstrip("/") / "requirements.lock", log)


def _site_packages(rootfs: Path, venv: str) -> Path:
    found = sorted((rootfs / venv.lstrip("/") / "lib").glob("python3*/site-packages"))
    if len(found) != 1:
        raise LabError(f"expected one site-packages under {venv}/lib in the image, found {len(found)}")
    return found[0]


def _is_sglang(name: str) -> bool:
    # the package and its dist-info (sglang-0.5.13.post1.dist-info); not sgl_kernel or other sgl* names
    return name == "sglang" or (name.startswith("sglang-") and name.endswith(".dist-info"))


def _server_args_smoke(rootfs: Path, python: str, version: str, log: Path, progress: Progress) -> None:
    """SGLang's own ServerArgs parse DFLASH flags under `python`, and it is the SGLang `version` (a venv
    that imports another SGLang than it should fails the build, not a test later)."""
    from ddtree_ops.lab.steps import capture

    progress(f"base image: checking that SGLang {version}'s ServerArgs parse DFLASH flags in {python}")
    result = capture(nspawn_oneshot(rootfs, python, "-c", SERVER_ARGS_SMOKE), timeout=600)
    with log.open("a") as out:
        out.write(f"\n### sglang {version} server_args smoke: exit {result.returncode}\n{result.stdout}{result.stderr}")
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        answer = None
    if result.returncode != 0 or not isinstance(answer, dict):
        raise LabError(f"SGLang {version} server_args smoke in the image failed (exit {result.returncode}); "
                       f"log: {log}\n{result.stderr.strip()[-2000:]}")
    if answer.get("version") != version or answer.get("algorithm") != "DFLASH" or not answer.get("draft"):
        raise LabError(f"SGLang {version} server_args smoke in the image: unexpected answer {answer} "
                       f"from {python}; log: {log}")


def _freeze(rootfs: Path, python: str, lock: Path, log: Path) -> None:
    from ddtree_ops.lab.steps import capture

    result = capture(nspawn_oneshot(rootfs, python, "-m", "pip", "freeze"), timeout=120)
    if result.returncode != 0:
        raise LabError(f"pip freeze in the image failed: {result.stderr.strip()}")
    lock.write_text(result.stdout)


if __name__ == "__main__":
    # `python3 -m ddtree_ops.lab.image apt-packages` prints what to apt-get before any venv exists
    # (this module needs only the standard library).
    # `venv-requirements` prints what the lab venv holds besides sglang (installed --no-deps), one
    # per line, so the control machine's dev venv (scripts/install.sh) tests the same stack.
    if sys.argv[1:] == ["apt-packages"]:
        print(" ".join(required_apt_packages()))
    elif sys.argv[1:] == ["venv-requirements"]:
        print("\n".join(VENV_REQUIREMENTS))
    else:
        print("usage: python3 -m ddtree_ops.lab.image apt-packages|venv-requirements", file=sys.stderr)
        sys.exit(2)
