"""`$ref` resolution inside one schema document: JSON pointers ("#/$defs/x", "#"), anchors
("#name" from `$anchor` or a draft-6/7 `$id: "#name"`) and the document's own `$id`.
References to other documents cannot be fetched (no network): lenient mode reports them and
allows any value there, strict mode refuses them."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.schema.schema_context import Context


def resolve_ref(ref: Any, path: str, ctx: Context) -> Any:
    """The schema `ref` points to; None (after ctx.skip) when it is in another document."""
    if not isinstance(ref, str):
        raise ConstraintError(f"$ref must be a string at {path}")
    document, _, fragment = ref.partition("#")
    if document and document not in _own_ids(ctx.root):
        ctx.skip("$ref", path, f"{ref!r} points to another document (no network access)")
        return None
    if not fragment or fragment.startswith("/"):
        return _pointer(ctx.root, fragment, ref)
    anchors = _anchors(ctx)
    if fragment not in anchors:
        raise ConstraintError(f"$ref {ref!r} at {path} does not resolve (no anchor {fragment!r})")
    return anchors[fragment]


def remote_refs(root: Any) -> list[str]:
    """The `$ref`s of a schema document that point to other documents (need the network)."""
    own, found, todo = _own_ids(root), [], [root]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.partition("#")[0] and ref.partition("#")[0] not in own:
                found.append(ref)
            todo.extend(
                v for k, v in node.items() if k not in ("enum", "const", "default", "examples")
            )
        elif isinstance(node, list):
            todo.extend(node)
    return found


def _own_ids(root: Any) -> set[str]:
    if not isinstance(root, dict):
        return set()
    ids = {root.get("$id"), root.get("id")}
    return {i.rstrip("#") for i in ids if isinstance(i, str)}


def _pointer(root: Any, fragment: str, ref: str) -> Any:
    target = root
    for raw in fragment.split("/")[1:]:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        elif isinstance(target, dict) and part in target:
            target = target[part]
        else:
            raise ConstraintError(f"$ref {ref!r} does not resolve")
    return target


def _anchors(ctx: Context) -> dict[str, Any]:
    if ctx.anchors is None:
        ctx.anchors = {}
        _collect_anchors(ctx.root, ctx.anchors)
    return ctx.anchors


def _collect_anchors(node: Any, found: dict) -> None:
    if isinstance(node, dict):
        for key in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(key), str):
                found.setdefault(node[key], node)
        for key in ("$id", "id"):
            if isinstance(node.get(key), str) and node[key].startswith("#"):
                found.setdefault(node[key][1:], node)
        for value in node.values():
            _collect_anchors(value, found)
    elif isinstance(node, list):
        for value in node:
            _collect_anchors(value, found)
