"""`python -m run.vocab CORPUS OUT_VOCAB [SIZE]`: an uncased WordPiece vocabulary of at most SIZE entries (30,522)
trained on a corpus, for a model trained from scratch (pass it with --vocab and --vocab_size)."""
import sys

import data
from run import files


def train_wordpiece(texts, out_path, vocab_size=30522, min_frequency=2):
    """Train a new uncased WordPiece vocabulary on an iterable of texts; write it as vocab.txt."""
    from tokenizers import Tokenizer, trainers
    from tokenizers.models import WordPiece
    tokenizer = data._bert_pipeline(Tokenizer(WordPiece(unk_token="[UNK]")))
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=data.SPECIAL_TOKENS)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    files.atomic_write_text(out_path, "".join(token + "\n" for token, _ in vocab))
    return data.load_tokenizer(out_path)


def main(argv):
    """python -m run.vocab CORPUS OUT_VOCAB [SIZE]: an uncased WordPiece vocabulary of at most SIZE entries (30,522)
    trained on a corpus, for a model trained from scratch (pass it with --vocab and --vocab_size)."""
    if len(argv) not in (2, 3) or (len(argv) == 3 and not argv[2].isdigit()):
        sys.exit("usage: python -m run.vocab CORPUS OUT_VOCAB [SIZE]")
    try:
        tokenizer = train_wordpiece(data.iter_pretraining_texts(argv[0]), argv[1], *map(int, argv[2:]))
    except (data.DataError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"{argv[1]}: {tokenizer.get_vocab_size():,} entries, trained on {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])

