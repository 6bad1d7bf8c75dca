"""What an Updater (optim/update.py) hands to checkpoints and takes back from them: its masters and
optimizer state tensors under checkpoint names (`master.<name>`, `optim.<key>.<name>`), the
optimizer's step, and their bytes."""
import torch


class CheckpointedState:
  """The Updater's checkpoint side; it reads the Updater's optimizer, master, params, recipe and
  _owned."""

  def state_keys(self):
    """Optimizer state tensors shaped like their parameter (Adam moments, momentum buffers);
    factored state (Adafactor's row/column moments) is not checkpointed and restarts on resume."""
    return sorted({k for master in self.optimizer.state for k in self._shaped_state(master)})

  def _shaped_state(self, master):
    """Keys of `master`'s optimizer state tensors shaped like it (moments, momentum buffers)."""
    state = self.optimizer.state.get(master, {}) if master is not None else {}
    return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape == master.shape]

  def optimizer_step(self):
    state = next(iter(self.optimizer.state.values()), {})
    step = state.get('step', 0)
    return float(step.item() if torch.is_tensor(step) else step)

  def has_master_copy(self, name):
    """Whether `name`'s master is a separate fp32 copy (checkpointed as `master.<name>`)."""
    return self.recipe.has_master(self.params[name].dtype)

  def named_state(self, state_keys=None):
    """This rank's owned rows of masters and optimizer state under checkpoint names:
    `master.<name>` (separate copies only) and `optim.<key>.<name>`."""
    out, keys = {}, (self.state_keys() if state_keys is None else state_keys)
    for n, m in self.master.items():
      if self.has_master_copy(n):
        out[f'master.{n}'] = m.detach()
      for key in keys:
        if key in self.optimizer.state.get(m, {}):
          out[f'optim.{key}.{n}'] = self.optimizer.state[m][key]
    return out

  def load_named_state(self, arrays, optimizer_step):
    """Copy loaded rows (named as in `named_state`) into masters and optimizer state."""
    with torch.no_grad():
      for array, value in arrays.items():
        kind, rest = array.split('.', 1)
        if kind == 'master':
          if rest in self.master and self.has_master_copy(rest):
            self.master[rest][:value.shape[0]].copy_(value)
          continue
        key, name = rest.split('.', 1)
        if name not in self.master:
          continue                         # frozen here: its state is not this run's
        m = self.master[name]
        state = self.optimizer.state[m]
        if key not in state:
          state[key] = torch.zeros_like(m)      # the recipe's state dtype: the master's
        state[key][:value.shape[0]].copy_(value)
        # capturable optimizers (XLA) keep the step count on the parameter's device
        on = m.device if self.optimizer.defaults.get('capturable') else 'cpu'
        state['step'] = torch.tensor(float(optimizer_step), device=on)

  def refresh_masters(self):
    """After parameters were loaded: masters that are copies take the parameters' rows."""
    with torch.no_grad():
      for n, m in self.master.items():
        if self.has_master_copy(n):
          m.copy_(self._owned(n).float())

  def state_bytes(self):
    """Bytes of optimizer state plus master copies held by this rank."""
    total = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return total + sum(m.numel() * m.element_size() for n, m in self.master.items() if self.has_master_copy(n))
