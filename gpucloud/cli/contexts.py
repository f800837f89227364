"""Which API the CLI talks to and with which token: named contexts in a config file, as kubectl's
contexts, and the one resolution every command that calls the API goes through.

The file is `$GPUCLOUD_CONFIG`, else `$XDG_CONFIG_HOME/gpucloud/config.yaml`, else
`~/.config/gpucloud/config.yaml` (0600, its folder 0700 when the CLI makes it). A context names
an API URL, where its token is (`token_file`, preferred, or the token itself), and the CA that
signed the API's certificate; `current_context` is the one used unless told otherwise.

Each command resolves the URL and the token on their own, each from the first of:

- URL: `--api-url`; `GPUCLOUD_API_URL`; the context (`--context`, else `GPUCLOUD_CONTEXT`, else
  the current one); with no context at all, a local stack's settings when the environment holds
  them (`GPUCLOUD_DATA_DIR`, `GPUCLOUD_API__HOST`, `GPUCLOUD_API__PORT`: the shell a developer
  runs `gpucloud up` from).
- token: `--api-key`; `GPUCLOUD_API_KEY`; for operator commands `GPUCLOUD_API__OPERATOR_TOKEN`;
  the context's; for operator commands with no context at all and `GPUCLOUD_DATA_DIR` set, the
  operator token that data dir already holds.

Nothing here creates a token: a client that found none says how to configure one, instead of
minting an operator token in whatever directory it stands in (which no API knows). What the
resolution picked is kept with its source, so every refusal names the token and the URL it used.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError, field_validator, model_validator

from gpucloud.web.tls import is_loopback

if TYPE_CHECKING:
    from gpucloud.config import Settings

CONFIG_ENV = "GPUCLOUD_CONFIG"
CONTEXT_ENV = "GPUCLOUD_CONTEXT"
URL_ENV = "GPUCLOUD_API_URL"
KEY_ENV = "GPUCLOUD_API_KEY"
OPERATOR_TOKEN_ENV = "GPUCLOUD_API__OPERATOR_TOKEN"
DATA_DIR_ENV = "GPUCLOUD_DATA_DIR"
# The variables that say "this shell runs a local stack": its API's address follows from them.
LOCAL_STACK_ENV = (DATA_DIR_ENV, "GPUCLOUD_API__HOST", "GPUCLOUD_API__PORT")
LOCAL_CONTEXT = "local"

CONTEXT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

SET_CONTEXT_HINT = "gpucloud config set-context NAME --api-url https://API --token-file PATH --use"


class ConfigProblem(Exception):
    """The CLI is not told (or told wrongly) where the API is or what token to send: a usage error,
    whose message says what to do."""


def config_path() -> Path:
    """The CLI's config file (see the module doc); XDG says a relative XDG_CONFIG_HOME is ignored."""
    if explicit := os.environ.get(CONFIG_ENV):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".config"
    return base / "gpucloud" / "config.yaml"


def config_source() -> str:
    """Which rule picked `config_path()`."""
    if os.environ.get(CONFIG_ENV):
        return CONFIG_ENV
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    return "XDG_CONFIG_HOME" if xdg and Path(xdg).is_absolute() else "the default (~/.config)"


def check_name(name: str) -> str:
    if not CONTEXT_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a context name: letters, digits, '.', '_' and '-', starting with a letter or "
            "digit, at most 63 characters"
        )
    return name


def check_api_url(url: str) -> str:
    """`url` without a trailing slash, or ValueError saying what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{url!r} is not an API URL: it must be http:// or https:// and a host, e.g. https://api.example.com"
        )
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: an API URL carries no credentials, query or fragment (give the token apart)")
    return url.rstrip("/")


def sends_in_clear(url: str) -> bool:
    """Whether a token sent to `url` crosses a network unencrypted."""
    parts = urlsplit(url)
    return parts.scheme == "http" and not is_loopback(parts.hostname or "")


def check_readable_file(path: Path, *, what: str) -> Path:
    """`path` made absolute, or ValueError unless it is a file this user can read."""
    path = path.expanduser().absolute()
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist or is not a file")
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as exc:
        raise ValueError(f"{what} {path} cannot be read: {exc.strerror}") from None
    return path


def check_ca_file(path: Path) -> Path:
    path = check_readable_file(path, what="the CA file")
    try:
        ssl.create_default_context().load_verify_locations(cafile=str(path))
    except ssl.SSLError:
        raise ValueError(f"the CA file {path} holds no PEM certificate") from None
    return path


def token_prefix(token: str) -> str:
    """What may be shown of a token: its kind's prefix (`gpc_`, `gpo_`, `gpcop_`), nothing secret."""
    head = token[:8]
    return head[: head.index("_") + 1] if "_" in head else ""


class Context(BaseModel):
    """One API and how to call it."""

    model_config = ConfigDict(extra="forbid")

    api_url: str
    token_file: Path | None = None
    token: SecretStr | None = None
    ca_file: Path | None = None

    @field_validator("api_url")
    @classmethod
    def _url(cls, url: str) -> str:
        return check_api_url(url)

    @field_validator("token_file", "ca_file")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        # Relative to what? A command runs from anywhere: the file names each path in full.
        if path is not None and not path.expanduser().is_absolute():
            raise ValueError(f"{path} is not an absolute path")
        return path.expanduser() if path is not None else None

    @model_validator(mode="after")
    def _one_token(self) -> Context:
        if self.token_file is not None and self.token is not None:
            raise ValueError("a context holds token_file or token, not both")
        return self

    def token_source(self, name: str, file: Path) -> str:
        if self.token_file is not None:
            return f"context '{name}' ({self.token_file})"
        return f"context '{name}' (the token written in {file})"

    def read_token(self, name: str, file: Path) -> str | None:
        """The context's token (None when it has none), or ConfigProblem saying what to fix."""
        if self.token is not None:
            return self.token.get_secret_value()
        if self.token_file is None:
            return None
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise ConfigProblem(
                f"context '{name}' takes its token from {self.token_file}, which cannot be read ({exc.strerror}): "
                f"restore the file, or point the context at another with "
                f"`gpucloud config set-context {name} --token-file PATH`"
            ) from None
        if not token:
            raise ConfigProblem(
                f"context '{name}' takes its token from {self.token_file}, which is empty: write the token there, "
                f"or `gpucloud config set-context {name} --token-file PATH`"
            )
        return token


class ClientConfig(BaseModel):
    """The config file: the contexts by name, and the current one."""

    model_config = ConfigDict(extra="forbid")

    current_context: str | None = None
    contexts: dict[str, Context] = {}

    @model_validator(mode="after")
    def _names(self) -> ClientConfig:
        for name in self.contexts:
            check_name(name)
        if self.current_context is not None and self.current_context not in self.contexts:
            raise ValueError(
                f"current_context {self.current_context!r} is not among its contexts "
                f"({', '.join(sorted(self.contexts)) or 'none'})"
            )
        return self

    def as_yaml(self) -> str:
        contexts = {}
        for name, context in sorted(self.contexts.items()):
            entry: dict[str, str] = {"api_url": context.api_url}
            if context.token_file is not None:
                entry["token_file"] = str(context.token_file)
            if context.token is not None:
                entry["token"] = context.token.get_secret_value()
            if context.ca_file is not None:
                entry["ca_file"] = str(context.ca_file)
            contexts[name] = entry
        return yaml.safe_dump({"current_context": self.current_context, "contexts": contexts}, sort_keys=False)


def load(path: Path | None = None) -> ClientConfig:
    """The config file's contents (empty when there is none), or ConfigProblem naming the file."""
    path = path or config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return ClientConfig()
    except OSError as exc:
        raise ConfigProblem(f"the CLI's config file {path} cannot be read ({exc.strerror})") from None
    try:
        return ClientConfig.model_validate(yaml.safe_load(text) or {})
    except yaml.YAMLError as exc:
        raise ConfigProblem(f"the CLI's config file {path} is not YAML ({exc}): fix it or move it away") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise ConfigProblem(f"the CLI's config file {path} is not valid ({problems}): fix it or move it away") from None


def save(config: ClientConfig, path: Path | None = None) -> Path:
    """Write the config file whole (0600); a folder the CLI makes for it is 0700."""
    from gpucloud.config import write_private

    path = path or config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, config.as_yaml())
    return path


@dataclass(frozen=True)
class Remembered:
    """Where `gpucloud up` wrote its context, and whether it is the current one."""

    file: Path
    current: bool
    token_file: Path | None


def remember_local_stack(settings: Settings, *, path: Path | None = None) -> Remembered:
    """Write the context 'local' for the stack `gpucloud up` runs with `settings`: its API, the
    data dir's operator token file (none when the token came from the environment: it is not
    copied here) and its CA; it becomes current only where no context is, so a deployment the
    user chose stays chosen."""
    path = path or config_path()
    config = load(path)
    token_file = None if settings.api.operator_token is not None else (settings.data_dir / "operator_token").resolve()
    ca_file = settings.tls.ca_file.resolve() if settings.tls.ca_file is not None else None
    config.contexts[LOCAL_CONTEXT] = Context(api_url=settings.api_url, token_file=token_file, ca_file=ca_file)
    if config.current_context is None:
        config.current_context = LOCAL_CONTEXT
    save(config, path)
    return Remembered(path, config.current_context == LOCAL_CONTEXT, token_file)


# ---------------------------------------------------------------- resolution


@dataclass(frozen=True)
class Source:
    """A value the resolution found, and where it came from (said to the user, never the value)."""

    value: str = field(repr=False)
    source: str
    context: str | None = None  # the context it came from, if it did
    local: bool = False  # it came from a local stack (`gpucloud up`'s context, or its settings)


@dataclass(frozen=True)
class Chosen:
    """The context in use (None: none is), and why it is the one."""

    name: str | None
    why: str
    context: Context | None
    file: Path


@dataclass(frozen=True)
class Connection:
    """The API a command calls, the token it sends, and where each came from."""

    url: Source
    token_from: Source
    ca_file: Path | None

    @property
    def api_url(self) -> str:
        return self.url.value

    @property
    def url_source(self) -> str:
        return self.url.source

    @property
    def token(self) -> str:
        return self.token_from.value

    @property
    def token_source(self) -> str:
        return self.token_from.source


def choose_context(flag: str | None) -> Chosen:
    """The context named by `flag` (`--context`), else GPUCLOUD_CONTEXT, else the current one."""
    file = config_path()
    config = load(file)
    env = os.environ.get(CONTEXT_ENV)
    name: str | None
    if flag:
        name, why = flag, "--context"
    elif env:
        name, why = env, CONTEXT_ENV
    else:
        name, why = config.current_context, f"the current context in {file}"
    if name is None:
        return Chosen(None, f"no context is set in {file}", None, file)
    if name not in config.contexts:
        known = ", ".join(sorted(config.contexts)) or "none yet"
        raise ConfigProblem(
            f"no context named {name!r} (from {why}) in {file} (it has: {known}): "
            f"make it with `gpucloud config set-context {name} --api-url URL --token-file PATH`"
        )
    return Chosen(name, why, config.contexts[name], file)


def _local_stack_vars() -> list[str]:
    return [name for name in LOCAL_STACK_ENV if os.environ.get(name)]


def _checked_url(url: str, source: str) -> Source:
    try:
        return Source(check_api_url(url), source)
    except ValueError as exc:
        raise ConfigProblem(f"{source}: {exc}") from None


def resolve_url(api_url: str | None, chosen: Chosen) -> Source | None:
    if api_url:
        return _checked_url(api_url, "--api-url")
    if env := os.environ.get(URL_ENV):
        return _checked_url(env, URL_ENV)
    if chosen.context is not None:
        return Source(
            chosen.context.api_url, f"context '{chosen.name}'", chosen.name, local=chosen.name == LOCAL_CONTEXT
        )
    if names := _local_stack_vars():
        from gpucloud.config import get_settings

        return Source(get_settings().api_url, f"the local stack's settings ({', '.join(names)})", local=True)
    return None


def resolve_token(
    api_key: str | None, chosen: Chosen, *, operator: bool, key_option: str = "--api-key"
) -> Source | None:
    if api_key:
        return Source(api_key, key_option)
    if env := os.environ.get(KEY_ENV):
        return Source(env, KEY_ENV)
    if operator and (setting := _operator_token_setting()) is not None:
        return setting
    if chosen.context is not None and chosen.name is not None:
        token = chosen.context.read_token(chosen.name, chosen.file)
        if token is None:
            return None
        return Source(token, chosen.context.token_source(chosen.name, chosen.file), chosen.name)
    if operator and os.environ.get(DATA_DIR_ENV):
        # The developer's stack (`gpucloud up` in this shell): its data dir's token, if the stack
        # made one. Read, never created: a token made here would be one no API knows.
        path = (Path(os.environ[DATA_DIR_ENV]) / "operator_token").absolute()
        if path.is_file() and (token := path.read_text().strip()):
            return Source(token, f"{DATA_DIR_ENV} ({path})")
    return None


def _operator_token_setting() -> Source | None:
    """GPUCLOUD_API__OPERATOR_TOKEN, from the environment or the settings' secrets dir."""
    if env := os.environ.get(OPERATOR_TOKEN_ENV):
        return Source(env, OPERATOR_TOKEN_ENV)
    if directory := os.environ.get("GPUCLOUD_SECRETS_DIR"):
        path = Path(directory) / OPERATOR_TOKEN_ENV
        if path.is_file() and (token := path.read_text().strip()):
            return Source(token, f"GPUCLOUD_SECRETS_DIR ({path.absolute()})")
    return None


def resolve(
    *,
    api_url: str | None = None,
    api_key: str | None = None,
    operator: bool = False,
    context: str | None = None,
    key_option: str = "--api-key",
) -> Connection:
    """The API and token a command uses (see the module doc), or ConfigProblem saying what to do."""
    chosen = choose_context(context)
    url = resolve_url(api_url, chosen)
    if url is None:
        raise ConfigProblem(no_api_message(chosen, operator=operator))
    token = resolve_token(api_key, chosen, operator=operator, key_option=key_option)
    if token is None:
        raise ConfigProblem(no_token_message(chosen, url, operator=operator, key_option=key_option))
    return Connection(url, token, ca_file_for(chosen, url))


def ca_file_for(chosen: Chosen, url: Source) -> Path | None:
    """The context's CA, trusted for the context's own URL only (GPUCLOUD_TLS__CA_FILE serves the others)."""
    if chosen.context is None or url.context != chosen.name:
        return None
    return chosen.context.ca_file


def _token_variables(operator: bool) -> str:
    if operator:
        return f"{OPERATOR_TOKEN_ENV} (an operator token) or {KEY_ENV} (an API key)"
    return f"{KEY_ENV} (the tenant's API key)"


def no_api_message(chosen: Chosen, *, operator: bool) -> str:
    return (
        f"the CLI does not know which API to call: {chosen.why}, and {URL_ENV} is unset.\n"
        f"Point it at a deployment once: `{SET_CONTEXT_HINT}` (the file holds a tenant's API key or an "
        f"operator token; keep it 0600), or for this shell export {URL_ENV} and {_token_variables(operator)}.\n"
        f"`gpucloud up` sets a context '{LOCAL_CONTEXT}' for the stack it runs."
    )


def no_token_message(chosen: Chosen, url: Source, *, operator: bool, key_option: str) -> str:
    where = f"the API at {url.value} (from {url.source})"
    if chosen.context is not None:
        return (
            f"no token to call {where}: context '{chosen.name}' has none. Give it one with "
            f"`gpucloud config set-context {chosen.name} --token-file PATH`, or pass {key_option} or set "
            f"{_token_variables(operator)}"
        )
    return (
        f"no token to call {where}: {chosen.why}. Pass {key_option}, set {_token_variables(operator)}, or "
        f"configure a context: `{SET_CONTEXT_HINT}`"
    )
