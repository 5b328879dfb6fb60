"""Train a word-level LSTM language model with Gluon, on one process or on N workers.

The same script runs alone or under any dist_gluon backend:

    python examples/language_model/train_lm.py
    python -m dist_gluon.launch -n 2 --backend horovod -- \\
        python examples/language_model/train_lm.py --plot runs/lm.png

Data: the English text that ships with Python itself, Python's documentation topics
and the docstrings and comments of the standard library (PSF licence; see
``corpus.py`` beside this script for exactly what is read, how it is split and how the
vocabulary is built): about 540,000 training words over a vocabulary of about 13,400
words. Nothing is downloaded.

The model is the classic one of Zaremba et al. (2014): an embedding, a 2-layer LSTM
and a decoder over the vocabulary, trained with truncated back-propagation through
time (the hidden state is carried from one window of ``--bptt`` words to the next and
detached), SGD with gradient clipping, and the learning rate divided by 4 after an
epoch that did not improve the validation perplexity.

What makes it distributed (everything else is a plain Gluon training loop):
- the embedding has row_sparse gradients (``sparse_grad=True``): a batch touches a few
  hundred of its rows, and ``dg.DistributedTrainer`` sums only the rows the workers'
  batches used;
- each worker trains on its own contiguous slice of the token stream, of equal length,
  cut into ``--batch-size`` columns: N workers hold the N x B columns one process with
  batch N x B would, so they train like it;
- ``trainer.allreduce_grads()``, the clipping of the summed gradients, then
  ``trainer.update()``;
- the validation stream is sharded the same way and the loss sums and word counts are
  summed over the workers with ``dg.reduce_metric``: the perplexity is that of every
  validation word, exactly;
- over slow links, ``--sync-every H`` trains with Local SGD (each worker steps alone on
  its own clipped gradient, the weights are averaged every H steps) and ``--outer-lr``
  with DiLoCo (an outer Nesterov step on the workers' average every H steps); the last
  round of an epoch is cut short, so that every epoch's validation perplexity is that
  of the weights every worker agrees on (see docs/slow-links.md);
- ``dg.Checkpointer`` writes a checkpoint every epoch and ``--resume`` continues from it
  exactly (dropout is seeded per epoch and rank, so a resumed epoch draws the masks an
  uninterrupted run would);
- elastic jobs (``dist_gluon.launch --nnodes MIN:MAX``): after every step
  ``dg.stop_requested()`` tells every worker at once that the launcher wants to re-form
  the job; the script saves a checkpoint at that window and exits, and the restarted
  workers (``--resume``) continue at the same fraction of the epoch. On the same number
  of workers that is the next window of the same columns; on another number the stream
  is cut into other columns, so the resumed epoch covers each column's remaining part
  of the same length, not exactly the words left out. The LSTM state starts from zeros
  at a resume;
- or, with ``--elastic-memory`` (horovod), the loop runs as a ``@dg.elastic.run``
  function on a ``dg.elastic.State`` committed after every window (with the position in
  the epoch and the learning rate): a lost node costs the window in flight, the
  survivors go on in their processes on this formation's slices of the streams (a reset
  callback; the LSTM state starts from zeros), a joining node's worker gets the state
  from rank 0, and no checkpoint is needed (``--checkpoint-dir`` still serves restarts
  of the whole job).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import mxnet as mx
import numpy as np
from corpus import load_corpus  # examples/language_model/corpus.py, beside this script
from mxnet import autograd, gluon
from mxnet.gluon import nn, rnn

import dist_gluon as dg
from dist_gluon import timeline


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a word-level LSTM language model on the English text that "
                    "ships with Python, with dist_gluon.",
        epilog="example: python -m dist_gluon.launch -n 2 --backend horovod -- "
               "python examples/language_model/train_lm.py --plot runs/lm.png")
    parser.add_argument("--epochs", type=int, default=6, help="training epochs (default: 6)")
    parser.add_argument("--train-fraction", type=float, default=1.0,
                        help="train on the first this fraction of every training "
                             "document, a smaller corpus of the same kind of text "
                             "(default: 1, all of it); the vocabulary is always that of the "
                             "whole training set")
    parser.add_argument("--batch-size", type=int, default=10,
                        help="columns of the token stream each worker trains on; the global "
                             "batch is this times the number of workers, so it shrinks when "
                             "an elastic job re-forms with fewer workers; fewer columns, "
                             "more (clipped) steps per epoch (default: 10)")
    parser.add_argument("--bptt", type=int, default=35,
                        help="words per window of truncated back-propagation through time "
                             "(default: 35)")
    parser.add_argument("--eval-batch-size", type=int, default=10,
                        help="columns of the validation stream per worker (default: 10)")
    parser.add_argument("--emsize", type=int, default=200,
                        help="size of the word embeddings (default: 200)")
    parser.add_argument("--nhid", type=int, default=200,
                        help="size of each LSTM layer (default: 200)")
    parser.add_argument("--nlayers", type=int, default=2, help="LSTM layers (default: 2)")
    parser.add_argument("--dropout", type=float, default=0.2,
                        help="dropout after the embedding, between the LSTM layers and "
                             "before the decoder (default: 0.2)")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"),
                        help="sgd (plain, as Zaremba et al.) or adam (lazy: only the "
                             "embedding rows in use are updated) (default: sgd)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate on the gradient averaged over every worker's "
                             "words, the same for any number of workers unless --scale-lr "
                             "(default: 20 for sgd, 0.002 for adam)")
    parser.add_argument("--scale-lr", action="store_true",
                        help="N workers use N times --lr, for their N times larger global "
                             "batch (the linear scaling rule); a resume on another number "
                             "of workers rescales the restored rate (default: off)")
    parser.add_argument("--clip", type=float, default=0.25,
                        help="largest global norm of that averaged gradient (default: 0.25)")
    parser.add_argument("--compression", default="none", choices=("none", "fp16"),
                        help="gradient compression: none or fp16 (every gradient, the "
                             "embedding's rows too, travels as float16); 2-bit and PowerSGD "
                             "take dense gradients only (default: none)")
    parser.add_argument("--sync-every", type=int, default=1, metavar="H",
                        help="Local SGD: each worker steps on its own gradients and the "
                             "weights are averaged every H steps (default: 1, the gradients "
                             "are averaged every step)")
    parser.add_argument("--outer-lr", type=float, default=None,
                        help="DiLoCo: every --sync-every steps an outer Nesterov step of this "
                             "learning rate (momentum --outer-momentum) on the average of the "
                             "workers' weight deltas (default: none, Local SGD)")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="momentum of the outer step with --outer-lr (default: 0.9)")
    parser.add_argument("--sync-delay", type=int, default=0, metavar="D",
                        help="overlap each synchronisation's sum with the next D local steps "
                             "(1 to --sync-every): its update arrives D steps late "
                             "(default: 0, no overlap)")
    parser.add_argument("--local-sgd-warmup", type=int, default=0, metavar="STEPS",
                        help="post-local SGD: average the gradients every step for this many "
                             "steps before the rounds of --sync-every start (default: 0)")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="share of the corpus's words held out for validation, in "
                             "whole documents (default: 0.05)")
    parser.add_argument("--min-count", type=int, default=1,
                        help="words seen fewer times in the training set become <unk> "
                             "(default: 1, every training word is in the vocabulary)")
    parser.add_argument("--seed", type=int, default=42,
                        help="seed of the initial weights and of dropout "
                             "(default: 42)")
    parser.add_argument("--log-interval", type=int, default=50,
                        help="print progress every this many batches (default: 50)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="write a checkpoint there after every epoch, and at the step "
                             "where an elastic launcher asks the job to stop")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --checkpoint-dir, if "
                             "any, inside its epoch when it was saved at a stop (give it "
                             "from the first run of an elastic job)")
    parser.add_argument("--elastic-memory", action="store_true",
                        help="elastic jobs on horovod: keep the training state in memory "
                             "(dg.elastic.State, committed after every step) so that the "
                             "workers keep their processes when a node is lost or joins, "
                             "losing at most the step in flight, with no checkpoint "
                             "(docs/elastic.md); elsewhere the same as without it")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="write a PNG of the loss and perplexity curves to PATH")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    for name in ("epochs", "batch_size", "bptt", "eval_batch_size", "emsize", "nhid",
                 "nlayers", "min_count", "log_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.train_fraction <= 1:
        parser.error(f"--train-fraction must be in (0, 1], got {args.train_fraction}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.sync_every < 1 or args.local_sgd_warmup < 0:
        parser.error("--sync-every must be at least 1 and --local-sgd-warmup at least 0")
    if args.local_sgd_warmup and args.sync_every == 1 and args.outer_lr is None:
        parser.error("--local-sgd-warmup needs --sync-every > 1 or --outer-lr")
    if not 0 <= args.sync_delay <= args.sync_every:
        parser.error("--sync-delay must be from 0 to --sync-every")
    if args.lr is None:
        args.lr = 20.0 if args.optimizer == "sgd" else 0.002
    if args.lr <= 0 or args.clip <= 0:
        parser.error("--lr and --clip must be positive")
    return args


class WordLSTM(gluon.HybridBlock):
    """Embedding (row_sparse gradients) -> LSTM layers -> Dense decoder over the
    vocabulary, on (time, batch) word ids. The embedding and the decoder are separate
    weights: tying them would make the embedding's gradient dense."""

    def __init__(self, vocab: int, emsize: int, nhid: int, nlayers: int, dropout: float,
                 **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embedding = nn.Embedding(vocab, emsize, sparse_grad=True)
            self.drop = nn.Dropout(dropout)
            self.lstm = rnn.LSTM(nhid, num_layers=nlayers, dropout=dropout,
                                 input_size=emsize)
            self.decoder = nn.Dense(vocab, flatten=False, in_units=nhid)

    def begin_state(self, batch_size: int) -> list:
        return self.lstm.begin_state(batch_size=batch_size, func=mx.nd.zeros)

    def hybrid_forward(self, F, words, *state):
        output, state = self.lstm(self.drop(self.embedding(words)), list(state))
        return self.decoder(self.drop(output)), state


def batchify(ids: np.ndarray, columns: int, workers: int, rank: int) -> mx.nd.NDArray:
    """This worker's share of a token stream as a (length, columns) array.

    The stream is cut into ``workers * columns`` contiguous, equally long pieces (the
    last ``len(ids) % (workers * columns)`` words are dropped); worker ``rank`` gets
    pieces ``rank * columns`` to ``(rank + 1) * columns - 1``, its own contiguous
    slice of the stream, one piece per column. All workers together hold exactly the
    columns one process with ``workers * columns`` columns would."""
    length = len(ids) // (workers * columns)
    if length < 2:
        raise SystemExit(f"{len(ids)} words cannot fill {workers} worker(s) x {columns} "
                         f"columns of at least 2 words; use fewer columns or more words")
    share = ids[rank * columns * length:(rank + 1) * columns * length]
    return mx.nd.array(share.reshape(columns, length).T, dtype="float32")


def windows(stream: mx.nd.NDArray, bptt: int, first: int = 0):
    """(input, target) windows of at most ``bptt`` time steps, from window ``first`` on;
    the target is the input shifted by one word."""
    length = stream.shape[0]
    for start in range(first * bptt, length - 1, bptt):
        size = min(bptt, length - 1 - start)
        yield stream[start:start + size], stream[start + 1:start + 1 + size]


def num_windows(stream: mx.nd.NDArray, bptt: int) -> int:
    return -(-(stream.shape[0] - 1) // bptt)


def word_losses(loss_fn, output, targets) -> mx.nd.NDArray:
    """The cross-entropy of every word: (time * batch,) from (time, batch, vocab)
    scores (gluon's losses would average over all axes but the first)."""
    return loss_fn(output.reshape((-1, output.shape[-1])), targets.reshape((-1,)))


def clip_global_norm(params, max_norm: float) -> float:
    """``gluon.utils.clip_global_norm`` over every gradient, row_sparse ones included.

    The norm of a row_sparse gradient is that of its stored rows, and it is rescaled in
    place as row_sparse (gluon's version would make it dense, the whole table, first).
    Returns the norm before clipping."""
    grads = [p.grad() for p in params if p.grad_req != "null"]
    squares = [(g.data if g.stype == "row_sparse" else g).norm().square() for g in grads]
    norm = math.sqrt(mx.nd.add_n(*squares).asscalar())
    if norm > max_norm:
        for grad in grads:
            grad *= max_norm / norm
    return norm


def evaluate(net, stream, bptt: int, kv) -> float:
    """The mean cross-entropy over every worker's validation words (the same on every
    worker)."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    metric = mx.metric.Loss("loss")
    state = net.begin_state(stream.shape[1])
    for words, targets in windows(stream, bptt):
        output, state = net(words, *state)
        metric.update(None, [word_losses(loss_fn, output, targets)])
    return dg.reduce_metric(metric, kv=kv).get()[1]


def save_plot(history: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [h["epoch"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((left, "loss", "cross-entropy per word"),
                           (right, "ppl", "perplexity")):
        ax.plot(epochs, [h[f"train_{key}"] for h in history], "o-", label="train")
        ax.plot(epochs, [h[f"val_{key}"] for h in history], "o-", label="validation")
        ax.set(xlabel="epoch", ylabel=label, title=label.capitalize())
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    right.set_yscale("log")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


class Progress:
    """Where the training loop is (epoch, windows of it done, history, rate, counters)
    when the job keeps nothing in memory: a restart resumes from a checkpoint instead.
    ``dg.elastic.State`` (--elastic-memory) has the same attributes and keeps them."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def commit(self) -> None:
        """Nothing to keep between steps without --elastic-memory."""


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.time()
    kv = dg.create()

    def log(message: str) -> None:
        if kv.rank == 0:
            print(message, flush=True)

    corpus = load_corpus(args.val_fraction, args.min_count)
    vocab = len(corpus.vocab)
    train_ids = corpus.train_part(args.train_fraction)
    log(f"data: {corpus.source}; nothing is downloaded")
    log(f"data: {corpus.documents} documents, {len(corpus.train)} training words "
        f"(training on {len(train_ids)}), {len(corpus.val)} validation words in "
        f"{corpus.val_documents} documents ({corpus.unknown_val_words} of them <unk>); "
        f"vocabulary {vocab} words (<unk>, <eos> and every training word seen at least "
        f"{args.min_count} time(s))")

    def shard() -> tuple[mx.nd.NDArray, mx.nd.NDArray, int]:
        """This worker's training and validation streams and the windows per epoch, for
        the current formation of the job."""
        train_data = batchify(train_ids, args.batch_size, kv.num_workers, kv.rank)
        val_data = batchify(corpus.val, args.eval_batch_size, kv.num_workers, kv.rank)
        steps_per_epoch = num_windows(train_data, args.bptt)
        log(f"data: backend {kv.type}, {kv.num_workers} worker(s), each on a slice of "
            f"{train_data.size} training words in {args.batch_size} columns, "
            f"{steps_per_epoch} windows of {args.bptt} per epoch")
        return train_data, val_data, steps_per_epoch

    train_data, val_data, steps_per_epoch = shard()
    workers = kv.num_workers
    mx.random.seed(args.seed)
    net = WordLSTM(vocab, args.emsize, args.nhid, args.nlayers, args.dropout)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    params = list(net.collect_params().values())
    lr = args.lr * workers if args.scale_lr else args.lr
    rounds = {}
    if args.sync_every > 1 or args.outer_lr is not None:
        rounds = {"sync_every": args.sync_every, "local_sgd_warmup": args.local_sgd_warmup,
                  "sync_delay": args.sync_delay}
    if args.outer_lr is not None:
        rounds.update(outer_optimizer="nag", outer_optimizer_params={
            "learning_rate": args.outer_lr, "momentum": args.outer_momentum})
    trainer = dg.DistributedTrainer(net.collect_params(), args.optimizer,
                                    {"learning_rate": lr},
                                    kv=kv, compression=args.compression, **rounds)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    log(f"model: {sum(p.data().size for p in params)} parameters, embedding {vocab} x "
        f"{args.emsize} with row_sparse gradients; {args.optimizer}, lr {lr:g}"
        + (f" ({args.lr:g} x {workers} workers)" if args.scale_lr else "")
        + f", global batch {args.batch_size * workers} columns, clip {args.clip:g}; "
        f"compression: {args.compression}"
        + (f"; weights synchronised every {args.sync_every} steps after "
           f"{args.local_sgd_warmup} synchronised every step, "
           + (f"DiLoCo (outer Nesterov lr {args.outer_lr:g}, momentum "
              f"{args.outer_momentum:g})" if args.outer_lr is not None else "Local SGD")
           if rounds else ""))

    def set_rate() -> None:
        """The trainer's rate: the state's rate of one worker, times the workers of this
        formation with --scale-lr."""
        trainer.set_learning_rate(state.lr * (kv.num_workers if args.scale_lr else 1))

    checkpointer = dg.Checkpointer(args.checkpoint_dir, kv=kv) if args.checkpoint_dir else None
    # epoch: the epoch to train next; windows: (done, of) where in it to begin (a stop or
    # a fault inside it); lr: the rate of one worker, divided at every plateau; resumed:
    # the checkpoint was looked for
    values = dict(epoch=0, windows=(0, 1), history=[], best_val=math.inf, lr=args.lr,
                  train_time=0.0, words_seen=0, resumed=False)
    if args.elastic_memory:
        state = dg.elastic.State(net=net, trainer=trainer, **values)

        def on_reset() -> None:
            # the job re-formed: this formation's slices of the streams
            nonlocal train_data, val_data, steps_per_epoch
            log(f"re-formed: {kv.num_workers} worker(s) go on from the last step every "
                "worker finished (its state kept in memory)")
            train_data, val_data, steps_per_epoch = shard()

        state.register_reset_callbacks([on_reset])
    else:
        state = Progress(**values)

    def resume() -> None:
        """The newest checkpoint in --checkpoint-dir, if any, into the model, the trainer
        and the loop's position (a collective: inside train, so that a worker that joins
        an --elastic-memory job takes the state from its peers instead)."""
        restored = checkpointer.restore(net, trainer)
        if restored is None:
            log(f"resume: no checkpoint in {args.checkpoint_dir}, starting from scratch")
            return
        state.epoch = restored["epoch"]
        extra = restored.get("extra") or {}
        state.history = list(extra.get("history", []))
        state.best_val = extra.get("best_val", math.inf)
        state.windows = tuple(extra.get("windows", (0, 1)))
        # the restored rate was that of the saved run's workers
        state.lr = trainer.learning_rate / (restored["num_workers"] if args.scale_lr else 1)
        set_rate()
        done, of = state.windows
        where = (f"inside epoch {state.epoch + 1} after {done} of its {of} windows "
                 f"(saved by {restored['num_workers']} worker(s))" if done
                 else f"after epoch {state.epoch}")
        log(f"resume: continuing {where} from {args.checkpoint_dir} "
            f"(lr {trainer.learning_rate:g})")

    def train(state) -> bool:
        """The epochs from ``state.epoch`` on; False if the launcher asked the job to stop
        (a restart from the checkpoint follows)."""
        if args.resume and not state.resumed:
            resume()
            state.resumed = True
            state.commit()
        set_rate()
        workers, rank = kv.num_workers, kv.rank
        # the launcher's progress line (on a terminal) shows the time left
        timeline.expect_steps((args.epochs - state.epoch) * steps_per_epoch)
        for epoch in range(state.epoch, args.epochs):
            # rank 0's weights reach every rank; dropout masks differ between workers, and
            # each epoch's are the same whether it follows the previous one or a resume
            mx.random.seed(int(np.random.SeedSequence([args.seed, epoch, rank])
                               .generate_state(1)[0]))
            metric = mx.metric.Loss("loss")
            hidden = net.begin_state(args.batch_size)
            # the same fraction of the epoch, in this run's windows (exact on as many
            # workers)
            done, of = state.windows
            first = done * steps_per_epoch // of
            tic = time.time()
            stop_at = None
            epoch_words = 0
            # timeline.data: the time each window takes to arrive counts as waiting for
            # data in the launcher's report and timeline
            for batch, (words, targets) in enumerate(
                    timeline.data(windows(train_data, args.bptt, first)), start=first + 1):
                hidden = [h.detach() for h in hidden]
                with autograd.record():
                    output, hidden = net(words, *hidden)
                    loss = word_losses(loss_fn, output, targets)
                loss.backward()
                # The gradients are summed over every worker's words; clipping the sum at
                # clip x (all workers' words) clips their average at clip. In a Local SGD
                # step a worker's gradient is its own words' sum.
                local = rounds and trainer.optimizer.num_update >= args.local_sgd_warmup
                trainer.allreduce_grads()
                clip_global_norm(params, args.clip * loss.size * (1 if local else workers))
                trainer.update(loss.size)
                metric.update(None, [loss])
                state.words_seen += loss.size * workers
                epoch_words += loss.size * workers
                state.windows = (batch, steps_per_epoch)
                if batch % args.log_interval == 0 or batch == steps_per_epoch:
                    batch_loss = metric.get()[1]
                    log(f"epoch {epoch + 1}/{args.epochs} [{batch:>4}/{steps_per_epoch}] "
                        f"loss {batch_loss:.3f} ppl {math.exp(batch_loss):8.1f} "
                        f"lr {trainer.learning_rate:g}")
                if args.elastic_memory:
                    # a step boundary: a lost node costs at most the step after it, and a
                    # node joins or leaves here (the commit raises on every rank)
                    state.commit()
                elif dg.stop_requested(kv):       # the same answer on every worker
                    stop_at = batch
                    break
            if stop_at is not None and stop_at < steps_per_epoch:
                if checkpointer is not None:
                    checkpointer.save(net, trainer, epoch, step=stop_at,
                                      extra={"history": state.history,
                                             "best_val": state.best_val,
                                             "windows": (stop_at, steps_per_epoch)})
                log("stop: the launcher asked the job to stop; "
                    + (f"checkpoint of epoch {epoch + 1} after {stop_at} of its "
                       f"{steps_per_epoch} windows saved, exiting for the restart "
                       "(--resume)" if checkpointer is not None else
                       "exiting without a checkpoint (no --checkpoint-dir): the restart "
                       "begins afresh"))
                return False
            trainer.sync_weights()   # with --sync-every: the epoch's last round, cut short
            mx.nd.waitall()
            elapsed = max(time.time() - tic, 1e-9)
            train_loss = dg.reduce_metric(metric, kv=kv).get()[1]
            val_loss = evaluate(net, val_data, args.bptt, kv)
            speed = epoch_words / elapsed
            state.train_time += elapsed
            state.history = state.history + [{
                "epoch": epoch + 1, "train_loss": train_loss,
                "train_ppl": math.exp(train_loss), "val_loss": val_loss,
                "val_ppl": math.exp(val_loss), "lr": trainer.learning_rate}]
            log(f"epoch {epoch + 1}/{args.epochs}: train_ppl={math.exp(train_loss):.2f} "
                f"val_ppl={math.exp(val_loss):.2f} val_loss={val_loss:.4f} "
                f"lr={trainer.learning_rate:g} time={elapsed:.1f}s words/s={speed:.0f}")
            if val_loss < state.best_val:
                state.best_val = val_loss
            else:
                state.lr /= 4
                set_rate()
                log(f"validation perplexity did not improve: lr -> "
                    f"{trainer.learning_rate:g}")
            state.epoch, state.windows = epoch + 1, (0, 1)
            state.commit()
            if checkpointer is not None:
                checkpointer.save(net, trainer, epoch + 1,
                                  extra={"history": state.history,
                                         "best_val": state.best_val})
            if args.plot and kv.rank == 0:
                save_plot(state.history, args.plot)
                # beside the curves: each rank's step time, split (docs/observability.md)
                timeline.save_step_plot(timeline.steps_plot_path(args.plot))
            if stop_at is not None and epoch + 1 < args.epochs:  # at the epoch's last step
                log(f"stop: the launcher asked the job to stop at the end of epoch "
                    f"{epoch + 1}; exiting for the restart (--resume)")
                return False
        return True

    if not (dg.elastic.run(train) if args.elastic_memory else train)(state):
        return
    history = state.history
    if not history or state.train_time == 0:
        log(f"the checkpoint is at epoch {state.epoch}, --epochs is {args.epochs}: "
            "nothing to train, evaluating it")
        val_loss = evaluate(net, val_data, args.bptt, kv)
        history.append({"epoch": state.epoch, "val_loss": val_loss,
                        "val_ppl": math.exp(val_loss)})
    elif args.plot:
        steps = timeline.steps_plot_path(args.plot)
        log(f"plot: {args.plot}" + (f", step times by rank: {steps}"
                                    if os.path.exists(steps) else ""))
    final = history[-1]
    speed = state.words_seen / state.train_time if state.train_time else float("nan")
    log(f"summary: val_ppl={final['val_ppl']:.2f} val_loss={final['val_loss']:.4f} "
        f"epochs={final['epoch']} vocab={vocab} backend={kv.type} workers={kv.num_workers} "
        f"sync_every={args.sync_every} "
        f"words/s={speed:.0f} time={time.time() - started:.1f}s")


if __name__ == "__main__":
    main()
