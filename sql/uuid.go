package sql

import "github.com/jackc/pgx/v5/pgtype"

// UUID is u as a statement argument. Not a uuid.UUID: pgx encodes that
// through its driver.Valuer (a string, a failed encode, then a parse),
// which took a quarter of a claim pass's CPU. Nor a [16]byte: pgx encodes
// that only once the server has described the statement, so the query
// modes that do not describe it (default_query_exec_mode exec and
// simple_protocol, which PgBouncer's transaction pooling needs) failed
// every call (TestQueryExecModes). pgx encodes a pgtype.UUID directly,
// in binary or text.
func UUID(u [16]byte) pgtype.UUID { return pgtype.UUID{Bytes: u, Valid: true} }

// UUIDs is us as a statement argument, each as UUID makes it (never nil,
// so that an empty slice is an empty array, not NULL). pgx encodes a
// uuid.UUID alone through its driver.Valuer in every mode, but has no
// text encoding for a slice of them.
func UUIDs[T ~[16]byte](us []T) []pgtype.UUID {
	out := make([]pgtype.UUID, len(us))
	for i, u := range us {
		out[i] = UUID(u)
	}
	return out
}
