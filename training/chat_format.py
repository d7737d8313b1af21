"""The chat template as token pieces: a conversation laid out token for token as the policy sees it, turn by
turn, without hard-coded special tokens (every piece is computed by rendering the tokenizer's template). Rollouts,
SFT, the record store and the served engines all lay out conversations with it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from array import array
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

BOUNDED_CONTEXT_CHECKS = 4  # observation pieces checked against the whole conversation's rendering, per ChatFormat
FRAME_CHECKS = 4  # observation pieces cut from a template's frame that are also rendered, per ChatFormat
# observations no template should change (leading and trailing white space, Jinja and HTML syntax): a template
# whose piece is not ``head + observation + tail`` for both has no frame
FRAME_SENTINELS = (" \n\tsentinel {{ one }} {% raw %}<b>&amp;</b>\n ", "\n\n  Sentinel two: 'x' \"y\"  \t")
ENCODED_TEXTS = 4096  # texts whose ids a ChatFormat keeps (those met most recently)
ENCODED_IDS = 2_000_000  # ids it keeps at most in all (4 bytes each): long observations keep fewer texts


class ChatFormat:
    """Token pieces of the chat template, computed by rendering it (no hard-coded special tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._eos_text = tokenizer.convert_ids_to_tokens(self.eos_token_id)
        self._lock = threading.Lock()  # a fast tokenizer is not to be called from two threads at once
        # observation pieces from a bounded context (see ``observation_piece``); the first few are checked against
        # the whole conversation, and a template whose rendering depends on the history gets the whole one always
        self._bounded = True
        self._checks_left = BOUNDED_CONTEXT_CHECKS
        # and, where the template puts an observation into its turn verbatim, cut from that frame without rendering
        self._frames: dict[tuple[tuple[str, str], ...], tuple[str, str] | None] = {}
        self._framed = True
        self._frame_checks_left = FRAME_CHECKS
        self._encoded: dict[str, array] = {}  # text -> ids, the least recently met first (see ``encode_many``)
        self._encoded_ids = 0
        self.encode_hits = self.encode_misses = 0

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identity of the tokenizer's vocabulary, merges and chat template: token ids recorded under one
        fingerprint mean the same text under every tokenizer with it."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else json.dumps(sorted(self.tokenizer.get_vocab().items()))
        template = str(getattr(self.tokenizer, "chat_template", "") or "")
        return hashlib.sha256((vocab + "\0" + template).encode()).hexdigest()[:16]

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, those not met recently in one tokenizer call. The ids of the ``ENCODED_TEXTS`` texts met
        most recently are kept (``ENCODED_IDS`` ids at most in all): the samples of a group start from the same
        prompt and often meet the same observations, and tokenising them was the largest share of a rollout's own
        cost (encoding is a pure function of the text)."""
        if not texts:
            return []
        with self._lock:
            new = list(dict.fromkeys(text for text in texts if text not in self._encoded))
            self.encode_misses += len(new)
            self.encode_hits += len(texts) - len(new)
            if new:
                for text, encoded in zip(new, self.tokenizer(new, add_special_tokens=False)["input_ids"], strict=True):
                    self._encoded[text] = array("i", encoded)
                    self._encoded_ids += len(encoded)
            ids = [self._encoded.setdefault(text, self._encoded.pop(text)).tolist() for text in texts]  # now newest
            while len(self._encoded) > ENCODED_TEXTS or (self._encoded_ids > ENCODED_IDS and self._encoded):
                self._encoded_ids -= len(self._encoded.pop(next(iter(self._encoded))))
            return ids

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids a trajectory starts with: the opening messages and the generation prompt."""
        return self.prompts([messages])[0]

    def prompts(self, conversations: Sequence[list[dict[str, str]]]) -> list[list[int]]:
        """``prompt`` of each conversation, in one tokenizer call (a text met more than once, as the samples of one
        group, is encoded once)."""
        return self.encode_many([self.render(messages, generation_prompt=True) for messages in conversations])

    def reply(self, text: str) -> list[int]:
        """An assistant turn's ids as the policy emits them: the text, then the end-of-turn id."""
        return [*self.encode(text), self.eos_token_id]

    def conversation(self, messages: list[dict[str, str]], prompt_messages: int) -> tuple[list[int], list[int]]:
        """Token ids and loss mask of a whole conversation, laid out exactly as a rollout lays out a trajectory
        (the first ``prompt_messages`` messages are its prompt; assistant turns after them are trained, the
        observations between them are not). Computed from the template's rendering alone, so it needs no
        generation tags in the template (Qwen2.5's has none)."""
        ids = self.prompt(messages[:prompt_messages])
        mask = [0] * len(ids)
        for i in range(prompt_messages, len(messages)):
            if messages[i]["role"] == "assistant":
                piece, trained = self.reply(messages[i]["content"]), 1
            else:
                piece, trained = self.observation_piece(messages[:i], messages[i]["content"]), 0
            ids += piece
            mask += [trained] * len(piece)
        return ids, mask

    def observation_piece(self, messages: list[dict[str, str]], observation: str) -> list[int]:
        """Ids between the end-of-turn id of the last assistant turn and the next assistant turn's text."""
        return self.observation_pieces([(messages, observation)])[0]

    def observation_pieces(self, turns: Sequence[tuple[list[dict[str, str]], str]]) -> list[list[int]]:
        """``observation_piece`` of each (messages, observation), encoded in one tokenizer call.

        Rendered from a bounded context, the conversation's opening up to its first user message and its last
        assistant turn, so a turn costs the same at turn 30 as at turn 1 (rendering the whole history each turn
        made a trajectory quadratic in its turns, and was the rollout's largest cost on the client). The first
        ``BOUNDED_CONTEXT_CHECKS`` pieces are also rendered from the whole conversation; a template whose piece
        differs (one that looks at positions or earlier turns) is rendered from the whole conversation from then on.
        """
        return self.encode_many([self._piece_text(messages, observation) for messages, observation in turns])

    def _piece_text(self, messages: list[dict[str, str]], observation: str) -> str:
        context = self._bounded_context(messages)
        if context is messages:
            return self._render_piece(messages, observation)
        frame = self._frame(context)
        with self._lock:
            check, self._checks_left = self._checks_left > 0, self._checks_left - 1
            check_frame = frame is not None and self._frame_checks_left > 0
            self._frame_checks_left -= check_frame
        if frame is not None and not check and not check_frame:
            return frame[0] + observation + frame[1]
        piece = self._render_piece(context, observation)
        if check_frame and frame is not None and frame[0] + observation + frame[1] != piece:
            self._framed = False
            log.warning("the chat template changes an observation it renders; rendering every turn from now on")
        if check:
            whole = self._render_piece(messages, observation)
            if whole != piece:
                self._bounded = False
                log.warning("the chat template renders an observation differently with the whole history; "
                            "rendering the whole conversation every turn from now on")
                return whole
        return piece

    def _frame(self, context: list[dict[str, str]]) -> tuple[str, str] | None:
        """(head, tail) of an observation's piece after ``context``'s opening, where the template renders every
        observation as ``head + observation + tail`` (the same for both ``FRAME_SENTINELS``); else None. The first
        ``FRAME_CHECKS`` pieces cut from it are also rendered, and a difference turns frames off."""
        if not self._framed:
            return None
        key = tuple((m["role"], m["content"]) for m in context[:-1])
        if key not in self._frames:
            frame = None
            first = self._render_piece(context, FRAME_SENTINELS[0])
            if first.count(FRAME_SENTINELS[0]) == 1:
                head, tail = first.split(FRAME_SENTINELS[0])
                if all(self._render_piece(context, s) == head + s + tail for s in FRAME_SENTINELS[1:]):
                    frame = (head, tail)
            self._frames[key] = frame
        return self._frames[key]

    def _bounded_context(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` cut to its opening (up to its first user message) and its last (assistant) turn."""
        if not self._bounded or not messages or messages[-1]["role"] != "assistant":
            return messages
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first_user is None or len(messages) <= first_user + 2:
            return messages
        return [*messages[: first_user + 1], messages[-1]]

    def _render_piece(self, messages: list[dict[str, str]], observation: str) -> str:
        before = self.render(messages, generation_prompt=False)
        after = self.render([*messages, {"role": "user", "content": observation}], generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template re-renders earlier turns differently; cannot extend incrementally")
        return before[before.rindex(self._eos_text) + len(self._eos_text):] + after[len(before):]  # from end-of-turn


def opening_messages(conversation_start: tuple[dict[str, Any], dict[str, Any]], first_observation: str,
                     system_prompt: str | None = None) -> list[dict[str, str]]:
    """The prompt every episode starts from, for RL rollouts and SFT alike: the environment's instruction and
    its acknowledgement (AgentGym's ``conversation_start``), then the first observation."""
    human, gpt = conversation_start
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": human["value"]}, {"role": "assistant", "content": gpt["value"]},
            {"role": "user", "content": first_observation}]
