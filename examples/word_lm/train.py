"""A word-level LSTM language model, in the shape of pytorch/examples'
word_language_model/main.py: a corpus split into train/valid/test, batchified, trained with
truncated backpropagation through time; the hidden state is carried from batch to batch
inside an epoch, the learning rate lives in a global and is annealed by hand when the
validation loss stops improving, and the best validation loss so far is a global too.

    python examples/word_lm/original.py --epochs 6
"""

import argparse
import math
import os
import time

import torch
import torch.nn as nn

from ckpt_trainer import CheckpointSession

HERE = os.path.dirname(os.path.abspath(__file__))
parser = argparse.ArgumentParser(description="word-level LSTM language model")
parser.add_argument("--data", default=os.path.join(HERE, "..", "char_lm", "corpus.txt"))
parser.add_argument("--emsize", type=int, default=32, help="size of word embeddings")
parser.add_argument("--nhid", type=int, default=32, help="hidden units per layer")
parser.add_argument("--lr", type=float, default=20, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=6, help="upper epoch limit")
parser.add_argument("--batch_size", type=int, default=4, metavar="N")
parser.add_argument("--bptt", type=int, default=12, help="sequence length")
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, metavar="N")
parser.add_argument("--save", type=str, default="model.pt", help="where to save the best model")
args = parser.parse_args()
torch.manual_seed(args.seed)
torch.set_num_threads(1)


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]


class Corpus:
    def __init__(self, path):
        self.dictionary = Dictionary()
        with open(path, encoding="utf8") as f:
            words = [w for line in f for w in line.split() + ["<eos>"]]
        ids = torch.tensor([self.dictionary.add_word(w) for w in words], dtype=torch.int64)
        n = len(ids)
        self.train, self.valid, self.test = ids[:n * 8 // 10], ids[n * 8 // 10:n * 9 // 10], ids[n * 9 // 10:]


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[:nbatch * bsz].view(bsz, -1).t().contiguous()


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid = nhid

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.decoder.out_features)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(1, bsz, self.nhid), weight.new_zeros(1, bsz, self.nhid))


corpus = Corpus(args.data)
eval_batch_size = 2
train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, eval_batch_size)
test_data = batchify(corpus.test, eval_batch_size)
ntokens = len(corpus.dictionary.idx2word)
model = RNNModel(ntokens, args.emsize, args.nhid, args.dropout)
criterion = nn.NLLLoss()


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    global hidden
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in ckpt.batches(enumerate(range(0, train_data.size(0) - 1, args.bptt))):
        data, targets = get_batch(train_data, i)
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        ckpt.step(loss=loss)
        total_loss += loss.item()
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(f"| epoch {epoch:3d} | batch {batch:4d} | lr {lr:02.2f} | "
                  f"ms/batch {elapsed * 1000 / args.log_interval:5.2f} | loss {cur_loss:5.2f}",
                  flush=True)
            total_loss = 0.0
            start_time = time.time()


lr = args.lr
best_val_loss = None
ckpt = CheckpointSession(experiment="word_lm", run="word_lm", every_steps=25)
ckpt.keep(globals(), "lr", "best_val_loss", "hidden")
ckpt.restore(model=model)
for epoch in ckpt.epochs(args.epochs + 1, len(range(0, train_data.size(0) - 1, args.bptt)), start=1):
    epoch_start_time = time.time()
    train()
    val_loss = evaluate(val_data)
    print(f"| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s | "
          f"valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}", flush=True)
    if not best_val_loss or val_loss < best_val_loss:
        with open(args.save, "wb") as f:
            torch.save(model.state_dict(), f)
        best_val_loss = val_loss
    else:
        lr /= 4.0

model.load_state_dict(torch.load(args.save, weights_only=True))
test_loss = evaluate(test_data)
print(f"| end of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}")
