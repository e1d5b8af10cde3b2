"""TFDS plumbing shared by the task families (`trace_jax.tasks.datasets`)."""

from trace_jax.tasks import datasets
from trace_jax.tasks.long_horizon import EpisodeBuilderConfig, RunningSumEpisodes


class _Raced(RunningSumEpisodes, skip_registration=True):
  """Builds as RunningSumEpisodes (the same name: the same files), but while it generates,
  another process (here a second builder) prepares the same dataset and finishes first, as runs
  started side by side do."""

  name = RunningSumEpisodes.name
  raced = False

  def _download_and_prepare(self, *args, **kwargs):
    if not _Raced.raced:
      _Raced.raced = True
      datasets.prepare(RunningSumEpisodes, self.builder_config, self._data_dir_root)
    return super()._download_and_prepare(*args, **kwargs)


def test_prepare_uses_the_dataset_another_process_prepared_first(tmp_path):
  config = EpisodeBuilderConfig(name="t3_8_4_0", turns=3, train_size=8, eval_size=4, seed=0)
  sources = datasets.prepare(_Raced, config, str(tmp_path))
  assert _Raced.raced
  alone = datasets.prepare(RunningSumEpisodes, config, str(tmp_path / "alone"))
  for split in ("train", "eval"):
    assert len(sources[split]) == len(alone[split])
    assert all(dict(sources[split][i]) == dict(alone[split][i])
               for i in range(len(alone[split])))
