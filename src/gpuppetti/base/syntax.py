"""What well-formed Kubernetes names, URLs and image references look like: one definition for the config, the
command line and the DRA driver.

Every pattern is tried with ``fullmatch``: Python's ``$`` also matches before a final newline, so ``match`` took
``"gpu\\n"`` for a namespace. (The patterns keep their ``^...$``, which pydantic's and JSON Schema's engines read as
the whole text.)"""

from __future__ import annotations

import re
import urllib.parse

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# Without its length limit (253), which is_dns_subdomain adds: pydantic's patterns take no look-ahead.
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Kubernetes object UIDs are RFC 4122 UUIDs.
UID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
# An image reference as container tools parse it: [registry[:port]/]path[:tag][@digest], the path in lower case.
_IMAGE = re.compile(
    r"^(?:(?P<registry>[a-zA-Z0-9.-]+(?::[0-9]+)?)/)?"
    r"(?P<path>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}))?$"
)


def dns_label_problem(text: str) -> str | None:
    if DNS_LABEL.fullmatch(text):
        return None
    return "must be a DNS label: at most 63 lower-case letters, digits and '-', starting and ending with a " \
           "letter or digit"


def is_dns_subdomain(text: str) -> bool:
    return len(text) <= 253 and DNS_SUBDOMAIN.fullmatch(text) is not None


def dns_subdomain_problem(text: str) -> str | None:
    if is_dns_subdomain(text):
        return None
    return "must be a DNS subdomain: lower-case letters, digits, '-' and '.', at most 253 characters, each part " \
           "starting and ending with a letter or digit"


def http_url_problem(text: str) -> str | None:
    """Why ``text`` is not an http(s) URL with a host; None when it is."""
    example = "such as http://host.minikube.internal:9410"
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme not in ("http", "https"):
        return f"expected a URL starting with http:// or https://, {example}"
    if not parsed.hostname:
        return f"the URL has no host, expected one {example}"
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        return f"the URL's port is not a number from 1 to 65535, expected one {example}"
    return None


LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def label_key_problem(text: str) -> str | None:
    """Why ``text`` is not a label key ([prefix/]name, as Kubernetes checks it); None when it is."""
    prefix, _, name = text.rpartition("/")
    if prefix and not is_dns_subdomain(prefix):
        return f"its prefix {prefix!r} must be a DNS subdomain"
    if not LABEL_NAME.fullmatch(name):
        return "is not a label key: at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter " \
               "or digit, after an optional DNS-subdomain prefix and '/'"
    return None


def label_value_problem(text: str) -> str | None:
    if text and not LABEL_NAME.fullmatch(text):
        return "is not a label value: empty, or at most 63 letters, digits, '-', '_' and '.', starting and ending " \
               "with a letter or digit"
    return None


def image_problem(text: str) -> str | None:
    if not text:
        return "must not be empty"
    if _IMAGE.fullmatch(text) is None:
        return "is not an image reference such as registry.example/gpuppetti:0.1.0 (lower-case path, optional " \
               ":tag and @digest)"
    return None


def host_path_problem(text: str) -> str | None:
    """Why ``text`` is not an absolute path a hostPath volume takes (as the API server checks it: no '..' part),
    nor one that goes into a manifest and the layer's environment as it is (no control characters); None when it
    is."""
    if not text.startswith("/"):
        return "must be an absolute path on the node"
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in text):
        return "must not hold control characters (a newline, a tab)"
    if ".." in text.split("/"):
        return "must not have a '..' part"
    return None
