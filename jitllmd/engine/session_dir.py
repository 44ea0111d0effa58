"""-session-dir: named sessions kept across restarts, one session file each (engine/session_file.py), written when
their model is unloaded or the server stops, read back when it starts."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from . import session_file
from .engine import Engine

__all__ = ["SessionDir"]

log = logging.getLogger("jitllmd.sessions")

_ID = re.compile(r"s-\d{1,20}-\d{1,20}")  # what new_session_id makes: a file name, never a path
_SAVE_TIMEOUT_S = 120.0


class SessionDir:
    """A directory of session files named <session id>.kv."""

    def __init__(self, path: Path):
        self.path = path

    def keep(self, engine: Engine) -> int:
        """Save every named session of `engine` (each file written whole beside, then renamed over the old one). A
        session that cannot be saved is logged and left. -> how many were saved."""
        self.path.mkdir(parents=True, exist_ok=True)
        kept = 0
        for session in engine.sessions.list():
            if not _ID.fullmatch(session.id):
                continue
            target = self.path / f"{session.id}.kv"
            part = target.with_name(target.name + ".part")
            try:
                part.write_bytes(engine.save_session(session).result(timeout=_SAVE_TIMEOUT_S))
                part.replace(target)
                kept += 1
            except Exception as exc:  # a full disk, a session on another rank: the others are still kept
                part.unlink(missing_ok=True)
                log.warning("session %s of %s not kept: %s", session.id, engine.loaded.name, exc)
        return kept

    def bring_back(self, engines: list[Engine]) -> list[str]:
        """Restore every session file here into the loaded model it was saved from (by its weights), each with its own
        id; a file of no loaded model, or damaged, is logged and left as it is. -> the ids restored."""
        if not self.path.is_dir():
            return []
        decoders = [e for e in engines if e.loaded.runner is not None]
        prints = {id(e): session_file.identity(e.loaded)["fingerprint"] for e in decoders}
        taken = {s.id for e in engines for s in e.sessions.list()}
        back: list[str] = []
        for file in sorted(self.path.glob("*.kv")):
            try:
                saved = session_file.load(file.read_bytes())
                engine = next((e for e in decoders if prints[id(e)] == saved.model.get("fingerprint")), None)
                if engine is None:
                    log.warning("%s: saved from model %s (%s), which is not loaded", file.name, saved.model.get("name"), saved.model.get("file"))
                    continue
                sid = str(saved.meta.get("id"))
                session = engine.restore_session(saved, sid if _ID.fullmatch(sid) and sid not in taken else None).result(timeout=_SAVE_TIMEOUT_S)
            except (OSError, ValueError) as exc:
                log.warning("%s: not restored: %s", file.name, exc)
                continue
            taken.add(session.id)
            back.append(session.id)
        return back

    def forget(self, session_id: str) -> None:
        """A session closed: its file goes too."""
        if _ID.fullmatch(session_id):
            (self.path / f"{session_id}.kv").unlink(missing_ok=True)
