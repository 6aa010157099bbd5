def test_database_fixture(conn):
    assert conn.execute("SELECT count(*) FROM fastjobs_jobs").fetchone() == (0,)
