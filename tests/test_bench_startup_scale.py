from raytrain_ddp.bench.startup_scale import medians, table


def test_medians_and_table():
    runs = [
        {"stages": {"connect": 1.0, "workers": 4.0}, "ray only s": 3.0, "imports s": 2.0},
        {"stages": {"connect": 3.0, "workers": 6.0}, "ray only s": 5.0, "imports s": 4.0},
        {"stages": {"connect": 2.0, "workers": 8.0}, "ray only s": 4.0, "imports s": 9.0},
    ]
    assert medians(runs) == {"total": 9.0, "connect": 2.0, "workers": 6.0, "ray only s": 4.0, "imports s": 4.0}
    lines = table({8: runs, 2: runs[:1]}).splitlines()
    assert lines[0].startswith("| workers | total | python |")
    assert lines[2].startswith("| 2 | 5.0 | - | - | 1.0 |")  # sorted by size; absent stages as -
    assert lines[3].endswith("| 4.0 | 4.0 |")
