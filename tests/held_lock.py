"""A dataset whose reads take a module-level lock, for tests/test_loaders.py: a thread of the rank
holds the lock while the loader starts its workers, as Ray's threads hold theirs."""
import threading

import torch
from torch.utils.data import Dataset

LOCK = threading.Lock()


class TakesTheLock(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        with LOCK:
            return torch.zeros(3, 4, 4), index % 2
