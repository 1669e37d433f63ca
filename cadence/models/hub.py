"""Models by name: a Hugging Face Hub id becomes a local path, downloaded once.

    resolve_model(None)                          -> None: the embedded default
    resolve_model("x/model.gguf"), ("x/folder")  -> itself: a local file or folder
    resolve_model("Qwen/Qwen3-0.6B")             -> <cache>/models--Qwen--Qwen3-0.6B/snapshots/<commit>
    resolve_model("unsloth/Qwen3-0.6B-GGUF:Q8_0") -> .../snapshots/<commit>/Qwen3-0.6B-Q8_0.gguf
    resolve_model_options(options)               -> the options with the engine's model resolved

Which files make the model is ``hub_files.choose_files``. The path there:

    list the repository   the Hub (model_info); offline, unreachable or refused:
          │               the cached snapshot of the revision, if there is one
          ▼
    choose the files      a GGUF quantization (every shard), or a safetensors checkpoint
          ▼
    snapshot_download     those files only, into huggingface_hub's cache (download_dir, else
          │               $HF_HUB_CACHE): what other tools downloaded is reused; each file is
          │               written under a temporary name and renamed once whole; a dropped
          │               connection resumes with a range request; offline, the cache only
          ▼
    check they are all there -> the path load_model reads

huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and HF_HUB_CACHE when it is
imported, HF_TOKEN when it sends; it is imported here only for a Hub id. Every
failure is one ``ModelFetchError`` line naming the repository and what to do.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TextIO

from cadence.models.hub_files import GGUF, INDEX_FILE, Choice, ChoiceError, choose_files, weight_files

if TYPE_CHECKING:
    from cadence.config import EngineOptions

DEFAULT_REVISION = "main"
# owner/name, or owner/name:QUANT (llama.cpp's -hf form); names as the Hub allows them.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?::(?P<quant>[\w./-]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_LIST_TIMEOUT_S = 30.0


class ModelFetchError(ValueError):
    """A Hub model that cannot be had: the message is one line that says what to do."""


@dataclass(frozen=True)
class HubModel:
    """A model named by its Hub id: ``repo`` (owner/name), the GGUF ``quant`` asked for."""

    spec: str  # as the user wrote it
    repo: str
    quant: str | None


def parse_hub_id(spec: str) -> HubModel | None:
    """The Hub model ``spec`` names, or None if it cannot be a Hub id."""
    match = _HUB_ID.fullmatch(spec)
    if match is None or ".." in match["repo"] or "--" in match["repo"]:
        return None
    if match["quant"] is None and spec.lower().endswith(".gguf"):
        return None  # a GGUF file's path that is not there
    return HubModel(spec, match["repo"], match["quant"])


def is_hub_id(spec: str | None) -> bool:
    """Whether ``spec`` names a Hub model: no such local path, and shaped as a Hub id."""
    return spec is not None and not os.path.exists(spec) and parse_hub_id(spec) is not None


def resolve_model(spec: str | None, revision: str | None = None, download_dir: str | None = None,
                  log: TextIO | None = sys.stderr) -> str | None:
    """The local path of the model ``spec`` names (see the module doc); ``log`` gets a line
    before a download and one naming the path. ValueError for what is no model."""
    if spec is None or os.path.exists(spec):
        if revision is not None and spec is not None:
            raise ValueError(f"revision: {spec} is a local path; --revision applies to a model "
                             "given by its Hub id")
        return spec
    model = parse_hub_id(spec)
    if model is None:
        raise ValueError(f"model: no such file or folder: {spec} (a Hugging Face Hub model is "
                         "named owner/name, or owner/name:QUANT for a GGUF quantization)")
    if download_dir is not None and os.path.exists(download_dir) and not os.path.isdir(download_dir):
        raise ValueError(f"download_dir: {download_dir} is a file, not a folder")
    say = (lambda line: print(f"cadence: {line}", file=log, flush=True)) if log else (lambda line: None)
    return _Fetch(model, revision or DEFAULT_REVISION, download_dir, say).path()


def resolve_model_options(options: "EngineOptions", log: TextIO | None = sys.stderr) -> "EngineOptions":
    """``options`` with the engine's model a local path (a Hub id fetched; see ``resolve_model``);
    the revision and download folder, spent, are cleared."""
    engine = options.engine
    path = resolve_model(engine.model, engine.revision, engine.download_dir, log)
    if path == engine.model and engine.revision is None and engine.download_dir is None:
        return options
    engine = dataclasses.replace(engine, model=path, revision=None, download_dir=None)
    return dataclasses.replace(options, engine=engine)


class _Fetch:
    """One resolution of a Hub model: list, choose, download, check."""

    def __init__(self, model: HubModel, revision: str, download_dir: str | None,
                 say: Callable[[str], None]) -> None:
        from huggingface_hub import constants

        self.model, self.revision, self.say = model, revision, say
        self.cache_dir = os.path.abspath(os.path.expanduser(download_dir or constants.HF_HUB_CACHE))
        self.endpoint = constants.ENDPOINT
        self.offline_reason: str | None = None  # set once the cache is all there is

    def path(self) -> str:
        paths = self._list()
        try:
            choice = choose_files(paths, self.model.quant)
        except ChoiceError as err:
            raise self._not_available(str(err)) from None
        if self.offline_reason is None:
            self.say(f"model {self.model.spec}: fetching {self._describe(choice)} (revision "
                     f"{self.revision}) from {self.endpoint} into the Hugging Face cache at {self.cache_dir}")
        folder = self._download(choice.files)
        if choice.kind != GGUF:
            folder = self._download(weight_files(paths, _read_index(folder)))
            self._check_folder(folder)
        path = folder if choice.entry is None else os.path.join(folder, choice.entry)
        self.say(f"model {self.model.spec} (revision {self.revision}"
                 f"{', from the cache: ' + self.offline_reason if self.offline_reason else ''}) -> {path}")
        return path

    # ------------------------------------------------------------ listing

    def _list(self) -> list[str]:
        """The repository's files at the revision; from the cache when the Hub cannot say."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RevisionNotFoundError

        try:
            info = HfApi().model_info(self.model.repo, revision=self.revision, timeout=_LIST_TIMEOUT_S)
            return [sibling.rfilename for sibling in info.siblings or []]
        except RevisionNotFoundError as err:
            raise self._explain(err) from None
        except Exception as err:  # noqa: BLE001 - sorted by _explain; the cache may still serve
            if _unexplained(err):
                raise
            cached = self._cached_files()
            if cached is None:
                raise self._explain(err) from None
            self.offline_reason = self._offline_reason(err)
            return cached

    def _cached_files(self) -> list[str] | None:
        """The repository's files as the cache knows them: the listing a download kept (so the
        choice is the one made online), else the files of the revision's snapshot (whole ones:
        a link to a missing blob does not count); None if the cache has neither."""
        folder = self._snapshot_folder()
        if folder is None:
            return None
        listing = self._cached_listing()
        if listing is not None:
            return listing
        found = []
        for root, _, names in os.walk(folder):
            for name in names:
                if os.path.isfile(os.path.join(root, name)):
                    found.append(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"))
        return sorted(found)

    def _cached_listing(self) -> list[str] | None:
        try:  # older huggingface_hub keeps no listing
            from huggingface_hub import get_cached_repo_tree
            from huggingface_hub.errors import CachedRepoTreeNotFoundError
        except ImportError:
            return None
        try:
            return sorted(f.path for f in get_cached_repo_tree(
                self.model.repo, revision=self.revision, cache_dir=self.cache_dir))
        except CachedRepoTreeNotFoundError:
            return None

    def _snapshot_folder(self) -> str | None:
        storage = os.path.join(self.cache_dir, "models--" + self.model.repo.replace("/", "--"))
        commit = self.revision if _COMMIT.fullmatch(self.revision) else _read_text(
            os.path.join(storage, "refs", self.revision))
        folder = os.path.join(storage, "snapshots", commit) if commit else None
        return folder if folder is not None and os.path.isdir(folder) else None

    # ------------------------------------------------------------ downloading

    def _download(self, files: tuple[str, ...] | list[str]) -> str:
        """The snapshot folder, holding ``files`` whole (downloaded unless offline)."""
        from huggingface_hub import snapshot_download

        if self.offline_reason is not None:
            self._check_cached(files)
        try:
            folder = snapshot_download(
                self.model.repo, revision=self.revision, cache_dir=self.cache_dir,
                allow_patterns=[glob.escape(f) for f in files],
                local_files_only=self.offline_reason is not None)
        except Exception as err:  # noqa: BLE001 - sorted by _explain
            if _unexplained(err):
                raise
            raise self._explain(err) from None
        self._check_present(folder, files)
        return folder

    def _check_cached(self, files: tuple[str, ...] | list[str]) -> None:
        folder = self._snapshot_folder()
        assert folder is not None  # the listing came from it
        self._check_present(folder, files)

    def _check_present(self, folder: str, files: tuple[str, ...] | list[str]) -> None:
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise self._not_available(f"misses {', '.join(missing[:3])}{more}")

    def _check_folder(self, folder: str) -> None:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise self._not_available("has no config.json")

    # ------------------------------------------------------------ errors

    def _offline_reason(self, err: Exception) -> str:
        from huggingface_hub.errors import OfflineModeIsEnabled

        if isinstance(err, OfflineModeIsEnabled):
            return "HF_HUB_OFFLINE is set"
        return f"{self.endpoint} could not be reached ({_first_line(err)})"

    def _not_available(self, detail: str) -> ModelFetchError:
        """What the repository (or, offline, the cache) lacks."""
        spec = self.model.spec
        if self.offline_reason is None:
            return ModelFetchError(f"model: {self.model.repo} (revision {self.revision}) {detail}")
        return ModelFetchError(
            f"model: {spec} is not whole in the Hugging Face cache at {self.cache_dir} (the cached "
            f"copy {detail}) and {self.offline_reason}: download it once with network access, "
            "or pass a local path")

    def _explain(self, err: Exception) -> ModelFetchError:
        """The one line for a failure of huggingface_hub (see ``_unexplained``)."""
        from huggingface_hub import errors, get_token

        repo, where = self.model.repo, self.endpoint
        if isinstance(err, errors.GatedRepoError):
            if get_token() is None:
                return ModelFetchError(f"model: {repo} on {where} is gated: accept its terms on "
                                       f"{where}/{repo} and set HF_TOKEN to a token of that account")
            return ModelFetchError(f"model: {repo} on {where} is gated and the token (HF_TOKEN) "
                                   f"has no access: accept its terms on {where}/{repo} with that account")
        if isinstance(err, errors.RepositoryNotFoundError):
            return ModelFetchError(
                f"model: {self.model.spec} is no local file or folder, and {where} has no repository "
                f"{repo}: check the id, or set HF_TOKEN to a token with access if it is private")
        if isinstance(err, errors.RevisionNotFoundError):
            return ModelFetchError(f"model: {repo} has no revision {self.revision!r} on {where}: "
                                   "check --revision (a branch, tag or commit)")
        if isinstance(err, errors.OfflineModeIsEnabled) or (
                isinstance(err, errors.LocalEntryNotFoundError) and _is_offline()):
            return self._unreachable("HF_HUB_OFFLINE is set")
        if isinstance(err, errors.HfHubHTTPError) and err.response is not None:
            return ModelFetchError(
                f"model: {where} answered HTTP {err.response.status_code} for {repo} "
                f"({_first_line(err)}): try again later, or pass a local path")
        if isinstance(err, errors.LocalEntryNotFoundError) or _is_transport_error(err):
            cause = err.__cause__ if isinstance(err, errors.LocalEntryNotFoundError) and err.__cause__ else err
            return self._unreachable(f"{where} could not be reached ({_first_line(cause)})")
        return ModelFetchError(f"model: downloading {repo} into {self.cache_dir} failed "
                               f"({_first_line(err)}): run again (whole files already downloaded "
                               "are kept)")

    def _unreachable(self, why: str) -> ModelFetchError:
        return ModelFetchError(
            f"model: {self.model.spec} (revision {self.revision}) is not in the Hugging Face cache "
            f"at {self.cache_dir} and {why}: download it once with network access, or pass a "
            "local path")

    def _describe(self, choice: Choice) -> str:
        if choice.kind == GGUF:
            shards = f" in {len(choice.files)} shards" if len(choice.files) > 1 else ""
            return f"its {choice.label} GGUF{shards}"
        return "its safetensors checkpoint"


def _unexplained(err: Exception) -> bool:
    """Errors that are no failure to fetch (a TypeError: a bug): they go on as they are."""
    from huggingface_hub.errors import HfHubHTTPError

    return not isinstance(err, (HfHubHTTPError, OSError)) and not _is_transport_error(err)


def _is_transport_error(err: BaseException) -> bool:
    """A connection that failed or timed out (httpx2's errors; httpx's before huggingface_hub 2)."""
    for module in ("httpx2", "httpx"):
        transport = getattr(sys.modules.get(module), "TransportError", None)
        if transport is not None and isinstance(err, transport):
            return True
    return False


def _is_offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _read_index(folder: str) -> dict | None:
    path = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
