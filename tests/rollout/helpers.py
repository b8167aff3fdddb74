"""Shared helpers of the rollout (and eval) tests: scripted generators, a tiny model, a plain-forward reference."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.envs import answers
from sao_jax.envs import base
from sao_jax.envs import calculator
from sao_jax.models.config import get_model_config
from sao_jax.models.llama import Decoder


def prompt_index(tokenizer, examples):
  """Maps a rendered prompt to its example index (stubs recognise the problem from the context)."""
  out = {}
  for i, ex in enumerate(examples):
    ids, _ = tokenizer.apply_chat_template(ex.messages(), add_generation_prompt=True)
    out[tuple(ids)] = i
  return out


def problem_of(context, index):
  """(example index, prompt length) of the known prompt that `context` starts with."""
  for n in range(len(context), 0, -1):
    if tuple(context[:n]) in index:
      return index[tuple(context[:n])], n
  raise AssertionError('context starts with no known prompt')


def scripted(tok, texts, *, stop=True, logprob=-0.25):
  """A generator that replays `texts` (each + <|end|> unless it ends with a stop text) and records calls."""
  calls = []
  queue = list(texts)

  def gen(context, budget, stop_ids):
    calls.append((list(context), budget, stop_ids))
    ids = tok.encode(queue.pop(0))
    if stop and ids[-1] not in stop_ids:
      ids.append(tok.eos_id)
    ids = ids[:budget]
    return ids, [logprob] * len(ids)
  return gen, calls


def calc_script(examples, fmt='tag'):
  """Problem i: 0 -> answers at once; 1 -> tool call then answer; 2 -> tool calls forever (turn limit);
  3 -> rambles without a stop token; 4 -> tool call then a wrong answer."""
  def script(i, c):
    ex = examples[i]
    tool, final = calculator.demo_actions(ex, fmt)
    kind = i % 5
    if kind == 0:
      return final, True
    if kind == 1:
      return (tool if c == 0 else final), True
    if kind == 2:
      return tool, True
    if kind == 3:
      return '1' * 200, False
    return (tool if c == 0 else answers.render(str(int(ex.answer) - 3), fmt)), True
  return script


class StatelessCalc:
  """A context-only generator (no call counter): the same context always gets the same answer."""

  def __init__(self, tok, index, script):
    self.tok, self.index, self.script = tok, index, script

  def __call__(self, context, max_new_tokens, stop_ids):
    i, n = problem_of(context, self.index)
    turn = self.tok.decode(context[n:]).count('<result>')  # Observations so far.
    text, stop = self.script(i, turn)
    ids = self.tok.encode(text)
    if stop and ids[-1] not in stop_ids:  # Inline mode stops on '</calc>' itself, else on end-of-turn.
      ids = ids + [self.tok.eos_id]
    ids = ids[:max_new_tokens]
    return ids, [-0.25 - 0.01 * j for j in range(len(ids))]


def small_model(vocab_size: int, seed: int) -> Decoder:
  cfg = get_model_config('tiny', vocab_size=vocab_size, num_layers=1, embed_dim=32, mlp_dim=64, head_dim=8,
                         eos_ids=(1,))
  return Decoder(cfg, rngs=nnx.Rngs(seed))


class PlainForward:
  """Logits of the Decoder's plain (no cache) forward pass over one sequence, right-padded to `length`."""

  def __init__(self, model: Decoder, length: int):
    self.length = length
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])
    self._fn = lambda x: fn(state, x)

  def logits(self, seq) -> np.ndarray:
    buf = np.zeros((1, self.length), np.int32)
    buf[0, :len(seq)] = seq
    return np.asarray(self._fn(jnp.asarray(buf)))[:len(seq)].astype(np.float64)


class PlainGreedy:
  """Reference generator: greedy decoding with the plain forward pass; returns temperature-1 log-probs."""

  def __init__(self, model: Decoder, length: int):
    self.forward = PlainForward(model, length)

  def __call__(self, context, max_new_tokens, stop_ids):
    ids, lps = [], []
    ctx = list(context)
    for _ in range(max_new_tokens):
      logits = self.forward.logits(ctx)[-1]
      tok = int(np.argmax(logits))
      ids.append(tok)
      lps.append(float(logits[tok] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()))
      ctx.append(tok)
      if tok in stop_ids:
        break
    return ids, lps


class ToolEchoEnv(base.BaseEnv):
  """Every turn ending on a stop text gets an observation; the episode runs to the turn limit."""

  def __init__(self, example, mode: str, stop_texts, max_turns: int, on_step=None):
    super().__init__(example, max_turns=max_turns)
    self.observation_mode = mode
    self.stop_texts = tuple(stop_texts)
    self.on_step = on_step

  def _step(self, action_text):
    if self.on_step is not None:
      self.on_step(self)
    return base.StepResult(f'<result>{self.turn}</result>', 0.0, False, {})


class EchoTask:
  name = 'echo'

  def __init__(self, examples, mode, stop_texts, max_turns, on_step=None):
    self._examples, self.mode, self.stop_texts, self.max_turns = examples, mode, stop_texts, max_turns
    self.on_step = on_step

  def eval_set(self):
    return list(self._examples)

  def make_env(self, example):
    return ToolEchoEnv(example, self.mode, self.stop_texts, self.max_turns, self.on_step)

  def close(self):
    pass


@contextlib.contextmanager
def lowerings():
  """The names of the programs jax lowers inside the block (a trace turned into a module for XLA): a program
  re-lowered for new argument placements shows here even when a compilation cache then finds its executable,
  and a jit's dispatch-cache entries that reuse a lowering (its `_cache_size`) do not."""
  names = []

  def listener(event, duration, **kwargs):
    del duration
    if event == '/jax/core/compile/jaxpr_to_mlir_module_duration':
      names.append(kwargs.get('fun_name', '?'))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
