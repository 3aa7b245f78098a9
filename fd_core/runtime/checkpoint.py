"""A checkpoint directory as one object: its JSON files read once, its tokenizer and chat template
loaded on first use, once per process; plain data when pickled (a rank receives it in the plan)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from fd_core.config import read_config_json
from fd_core.errors import CheckpointError, ConfigError
from fd_core.runtime import progress
from fd_core.runtime.text.chat import find_chat_template
from fd_core.runtime.text.generation_config import GenerationDefaults
from fd_core.runtime.text.tokenizer import has_tokenizer, load_tokenizer, read_json
from fd_core.runtime.weights import check_checkpoint_dir

if TYPE_CHECKING:
    from fd_core.runtime.text.tokenizer import Tokenizer

PREPROCESSOR_CONFIG = "preprocessor_config.json"


def architecture_of(data: Mapping[str, Any]) -> str | None:
    """The architecture a config.json names: `architectures[0]` as transformers writes it."""
    archs = data.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    name = data.get("architecture")
    return name if isinstance(name, str) and name else None


class Checkpoint:
    """config.json, generation_config.json and preprocessor_config.json of a directory, each read once;
    the tokenizer's files and the chat template read on first use and kept for this process."""

    def __init__(
        self, directory: str, config: dict[str, Any], generation: dict[str, Any], preprocessor: dict[str, Any] | None
    ) -> None:
        self.directory = directory
        self.config = config
        self.generation = generation
        self.preprocessor = preprocessor
        self._json: dict[Path, dict[str, Any]] = {}
        self._tokenizer: Tokenizer | None = None
        self._template: tuple[tuple[str, Path] | None] | None = None

    @classmethod
    def open(cls, directory: str | Path, weights: bool = True) -> "Checkpoint":
        """The directory checked (config.json and, with `weights`, weight files present; no pickle files) and its JSON
        files read."""
        path = Path(directory)
        check_checkpoint_dir(path, weights)
        try:
            config = read_config_json(path / "config.json")
        except ConfigError as exc:
            raise CheckpointError(f"checkpoint {exc}") from None
        preprocessor = read_json(path / PREPROCESSOR_CONFIG) if (path / PREPROCESSOR_CONFIG).exists() else None
        return cls(str(directory), config, read_json(path / "generation_config.json"), preprocessor)

    def __getstate__(self) -> dict[str, Any]:
        # What crosses into a rank is the data read; the tokenizer (a native object) is loaded there on use.
        return {
            "directory": self.directory,
            "config": self.config,
            "generation": self.generation,
            "preprocessor": self.preprocessor,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Checkpoint({self.directory!r})"

    @property
    def architecture(self) -> str | None:
        """The architecture config.json names, if any."""
        return architecture_of(self.config)

    def generation_defaults(self) -> GenerationDefaults:
        """End-of-sequence ids and sampling defaults (generation_config.json, then config.json's ids)."""
        directory = Path(self.directory)
        return GenerationDefaults.of(self.generation, self.config, source=str(directory / "generation_config.json"),
                                     model_source=str(directory / "config.json"))

    def _read(self, path: Path) -> dict[str, Any]:
        if path not in self._json:
            self._json[path] = read_json(path)
        return self._json[path]

    def has_tokenizer(self) -> bool:
        """Whether the directory holds a tokenizer fd reads."""
        return has_tokenizer(self.directory)

    def tokenizer(self) -> "Tokenizer":
        """The tokenizer, loaded on first use; a directory without one is a one-line error naming the files looked
        for."""
        if self._tokenizer is None:
            progress.report("loading the tokenizer")  # a rank stuck here is named for it, not for the phase before
            self._tokenizer = load_tokenizer(self.directory, self._read)
        return self._tokenizer

    def tokenizer_if_any(self) -> "Tokenizer | None":
        """The tokenizer, or None when the directory has none."""
        return self.tokenizer() if self.has_tokenizer() else None

    def chat_template(self) -> str | None:
        """The chat template (chat_template.jinja, chat_template.json or tokenizer_config.json's), if any."""
        found = self._find_template()
        return None if found is None else found[0]

    def chat_template_file(self) -> Path | None:
        """The file the chat template comes from, if there is one."""
        found = self._find_template()
        return None if found is None else found[1]

    def _find_template(self) -> tuple[str, Path] | None:
        if self._template is None:
            self._template = (find_chat_template(self.directory, self._read),)
        return self._template[0]
