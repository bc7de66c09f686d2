import pytest

from neuron.models.sharding import ShardingError, check_plan, split_even
from protocol import ModelConfig


def cfg(heads=9, kv=3, inter=1536, vocab=49152, experts=0):
    return ModelConfig(family="llama", vocab_size=vocab, hidden_size=576, intermediate_size=inter, num_layers=2,
                       num_heads=heads, num_kv_heads=kv, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=64, tie_word_embeddings=True, num_experts=experts)


def test_split_even_gives_the_remainder_to_the_first_ranks():
    assert [len(split_even(10, 3, r)) for r in range(3)] == [4, 3, 3]
    assert [split_even(10, 3, r).start for r in range(3)] == [0, 4, 7]


def test_three_kv_groups_over_two_ranks_split_two_plus_one():
    a, b = check_plan(cfg(), 2)
    assert (a.kv_heads, b.kv_heads) == (range(0, 2), range(2, 3))
    assert (a.q_heads, b.q_heads) == (range(0, 6), range(6, 9))
    assert a.kv_of_q == (0, 0, 0, 1, 1, 1) and b.kv_of_q == (0, 0, 0)
    assert (len(a.mlp), len(b.mlp)) == (768, 768)


def test_every_head_and_column_is_owned_exactly_once():
    for world in (1, 2, 3):
        plans = check_plan(cfg(), world)
        assert sorted(h for pl in plans for h in pl.q_heads) == list(range(9))
        assert sorted(c for pl in plans for c in pl.mlp) == list(range(1536))
        assert sum(len(pl.vocab) for pl in plans) >= 49152


def test_more_ranks_than_kv_heads_replicates_kv_and_splits_queries():
    plans = check_plan(cfg(heads=8, kv=2), 4)
    assert [pl.q_heads for pl in plans] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [pl.kv_heads for pl in plans] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    # 6 query heads over 4 ranks: a rank may straddle two KV groups and then holds both
    plans = check_plan(cfg(heads=6, kv=2), 4)
    assert plans[1].q_heads == range(2, 4) and plans[1].kv_heads == range(0, 2) and plans[1].kv_of_q == (0, 1)


def test_more_ranks_than_query_heads_is_refused_with_the_reason():
    with pytest.raises(ShardingError, match="more ranks than the model's 9 attention heads"):
        check_plan(cfg(), 10)


def test_experts_are_split_across_ranks():
    plans = check_plan(cfg(experts=8), 3)
    assert [len(pl.experts) for pl in plans] == [3, 3, 2]
