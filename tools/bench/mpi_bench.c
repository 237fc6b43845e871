/*
 * ciuic-mpi-bench: the OpenMPI baseline for ciuic-bench.
 *
 * Same flags and the same JSON keys as ciuic-bench, so that compare.py can
 * put the two side by side. Run it under mpirun; the number of ranks is the
 * MPI world size (--nodes and --ranks-per-node are accepted for flag
 * compatibility and only checked against it).
 *
 * Method, per size (nccl-tests conventions):
 *   - buffers are allocated once per size and pre-faulted by writing every
 *     page before any timing (a first touch costs ~10 us per 4 KiB page on
 *     these machines, which would otherwise dominate large sizes);
 *   - one cold op is timed on its own (reported as cold_us), then --warmup
 *     untimed ops, then one barrier, then --iters ops timed one by one with
 *     MPI_Wtime and no barrier between them;
 *   - time_us is the median over iterations of the max over ranks;
 *   - algbw = bytes / time, busbw = algbw * factor, with factor 2(n-1)/n for
 *     allreduce, (n-1)/n for reduce_scatter, allgather, alltoall and
 *     alltoallv, 1 for broadcast;
 *   - --check refills the buffers, runs one more (untimed) op and compares
 *     every output element with an expectation computed independently from
 *     the fill rule; errors is the number of mismatching elements summed over
 *     ranks (null in JSON, N/A in the table, without --check).
 *
 * The bytes of a size are the whole per-rank buffer as nccl-tests defines
 * them: the allreduce/broadcast buffer, the full (count*ranks) buffer of
 * allgather, reduce_scatter and alltoall, what each rank sends in all for
 * alltoallv (cut unevenly as ciuic-bench cuts it: rank i sends rank j a
 * share proportional to 1 + ((j - i) mod n), the remainder of the rounding
 * to the largest; every rank then also receives the size). A size that is not a multiple of
 * (element size * ranks) for those two is rounded down (at least one element
 * per rank); the JSON reports the bytes actually moved.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum Op { kAllreduce, kReduceScatter, kAllgather, kAlltoall, kAlltoallv, kBroadcast, kBarrier };
enum Dtype { kFloat32, kFloat64, kInt32 };

static const char* const kOpNames[] = {"allreduce", "reduce_scatter", "allgather", "alltoall",
                                       "alltoallv", "broadcast",      "barrier"};
static const char* const kDtypeNames[] = {"float32", "float64", "int32"};

#define kMaxSizes 64

typedef struct {
  enum Op op;
  enum Dtype dtype;
  size_t sizes[kMaxSizes];
  int num_sizes;
  int iters;
  int warmup;
  int check;
  int json;
  int nodes;           /* 0: not given */
  int ranks_per_node;  /* 0: not given */
} Options;

static int g_rank = 0;
static int g_nranks = 1;

static void Die(const char* fmt, const char* arg) {
  if (g_rank == 0) {
    fprintf(stderr, "ciuic-mpi-bench: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
  }
  MPI_Finalize();
  exit(2);
}

static void Usage(void) {
  if (g_rank != 0) return;
  fprintf(stderr,
          "usage: mpirun -np R ciuic-mpi-bench --op OP [--sizes 8,64K,16M,256M]\n"
          "         [--dtype float32|float64|int32] [--iters K] [--warmup K]\n"
          "         [--check] [--json] [--nodes N --ranks-per-node R]\n"
          "  OP: allreduce|reduce_scatter|allgather|alltoall|alltoallv|broadcast|barrier\n"
          "  sizes: bytes per rank, suffixes K, M, G (powers of 1024)\n");
}

/* Parses "64K"-style sizes; returns 0 on a malformed entry. */
static int ParseSizes(const char* list, Options* opt) {
  char* copy = strdup(list);
  char* save = NULL;
  opt->num_sizes = 0;
  for (char* tok = strtok_r(copy, ",", &save); tok != NULL;
       tok = strtok_r(NULL, ",", &save)) {
    if (opt->num_sizes == kMaxSizes) break;
    errno = 0;
    char* end = NULL;
    unsigned long long value = strtoull(tok, &end, 10);
    if (end == tok || errno != 0) {
      free(copy);
      return 0;
    }
    unsigned long long mult = 1;
    switch (*end) {
      case 'k': case 'K': mult = 1ull << 10; ++end; break;
      case 'm': case 'M': mult = 1ull << 20; ++end; break;
      case 'g': case 'G': mult = 1ull << 30; ++end; break;
      default: break;
    }
    if (*end == 'b' || *end == 'B') ++end;
    if (*end != '\0') {
      free(copy);
      return 0;
    }
    opt->sizes[opt->num_sizes++] = (size_t)(value * mult);
  }
  free(copy);
  return opt->num_sizes > 0;
}

static int ParseInt(const char* s, const char* flag) {
  char* end = NULL;
  long v = strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < 0 || v > INT_MAX) Die("bad value for %s", flag);
  return (int)v;
}

static void ParseArgs(int argc, char** argv, Options* opt) {
  memset(opt, 0, sizeof(*opt));
  opt->op = kAllreduce;
  opt->dtype = kFloat32;
  opt->iters = 20;
  opt->warmup = 5;
  int have_op = 0;
  ParseSizes("8,64K,16M,256M", opt);
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* next = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE() \
  do {               \
    if (!next) Die("%s needs a value", a); \
    ++i;             \
  } while (0)
    if (!strcmp(a, "--op")) {
      NEED_VALUE();
      int found = 0;
      for (int k = 0; k < (int)(sizeof(kOpNames) / sizeof(kOpNames[0])); ++k)
        if (!strcmp(next, kOpNames[k])) opt->op = (enum Op)k, found = 1;
      if (!found) Die("unknown --op %s", next);
      have_op = 1;
    } else if (!strcmp(a, "--dtype")) {
      NEED_VALUE();
      int found = 0;
      for (int k = 0; k < 3; ++k)
        if (!strcmp(next, kDtypeNames[k])) opt->dtype = (enum Dtype)k, found = 1;
      if (!found) Die("unknown --dtype %s", next);
    } else if (!strcmp(a, "--sizes")) {
      NEED_VALUE();
      if (!ParseSizes(next, opt)) Die("bad --sizes %s", next);
    } else if (!strcmp(a, "--iters")) {
      NEED_VALUE();
      opt->iters = ParseInt(next, a);
      if (opt->iters < 1) Die("%s must be >= 1", a);
    } else if (!strcmp(a, "--warmup")) {
      NEED_VALUE();
      opt->warmup = ParseInt(next, a);
    } else if (!strcmp(a, "--nodes")) {
      NEED_VALUE();
      opt->nodes = ParseInt(next, a);
    } else if (!strcmp(a, "--ranks-per-node")) {
      NEED_VALUE();
      opt->ranks_per_node = ParseInt(next, a);
    } else if (!strcmp(a, "--socket")) {
      NEED_VALUE(); /* ciuic-bench only; accepted and ignored */
    } else if (!strcmp(a, "--check")) {
      opt->check = 1;
    } else if (!strcmp(a, "--json")) {
      opt->json = 1;
    } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      Usage();
      MPI_Finalize();
      exit(0);
    } else {
      Usage();
      Die("unknown flag %s", a);
    }
#undef NEED_VALUE
  }
  if (!have_op) {
    Usage();
    Die("%s", "--op is required");
  }
  int expected = (opt->nodes ? opt->nodes : 1) *
                 (opt->ranks_per_node ? opt->ranks_per_node : g_nranks);
  if ((opt->nodes || opt->ranks_per_node) && expected != g_nranks) {
    char msg[128];
    snprintf(msg, sizeof(msg), "--nodes x --ranks-per-node = %d but mpirun started %d ranks",
             expected, g_nranks);
    Die("%s", msg);
  }
}

static size_t DtypeSize(enum Dtype d) { return d == kFloat64 ? 8 : 4; }

static MPI_Datatype MpiType(enum Dtype d) {
  switch (d) {
    case kFloat64: return MPI_DOUBLE;
    case kInt32: return MPI_INT32_T;
    default: return MPI_FLOAT;
  }
}

/* The input of `rank` at element `index`: a small integer, so that sums over
 * up to thousands of ranks are exact in every dtype. */
static inline int64_t FillValue(int rank, size_t index) {
  return (int64_t)((index * 3 + (size_t)rank * 5) % 17) - 8;
}

static void Store(void* buf, enum Dtype d, size_t i, int64_t v) {
  switch (d) {
    case kFloat32: ((float*)buf)[i] = (float)v; break;
    case kFloat64: ((double*)buf)[i] = (double)v; break;
    case kInt32: ((int32_t*)buf)[i] = (int32_t)v; break;
  }
}

static int Matches(const void* buf, enum Dtype d, size_t i, int64_t expected) {
  switch (d) {
    case kFloat32: return ((const float*)buf)[i] == (float)expected;
    case kFloat64: return ((const double*)buf)[i] == (double)expected;
    case kInt32: return ((const int32_t*)buf)[i] == (int32_t)expected;
  }
  return 0;
}

/* Sum over ranks of FillValue(r, index), computed without MPI. */
static int64_t ExpectedSum(size_t index) {
  int64_t s = 0;
  for (int r = 0; r < g_nranks; ++r) s += FillValue(r, index);
  return s;
}

/* alltoallv: elements rank i sends rank j out of `total` each rank sends
 * (ciuic-bench's UnevenCount, written again here). */
static size_t UnevenCount(size_t total, int i, int j) {
  size_t n = (size_t)g_nranks;
  size_t d = (size_t)(((j - i) % g_nranks + g_nranks) % g_nranks);
  size_t shares = n * (n + 1) / 2, given = 0;
  for (size_t w = 1; w <= n; ++w) given += total / shares * w + total % shares * w / shares;
  return total / shares * (d + 1) + total % shares * (d + 1) / shares +
         (d == n - 1 ? total - given : 0);
}

/* Element counts of one size, nccl-tests style. */
typedef struct {
  size_t send_count;  /* elements in the send buffer */
  size_t recv_count;  /* elements in the receive buffer */
  size_t bytes;       /* bytes reported: the full per-rank buffer */
} Shape;

static Shape ShapeFor(enum Op op, enum Dtype d, size_t bytes) {
  Shape s = {0, 0, 0};
  size_t es = DtypeSize(d);
  size_t n = (size_t)g_nranks;
  size_t count;
  switch (op) {
    case kAllreduce:
    case kBroadcast:
      count = bytes / es;
      if (count == 0) count = 1;
      s.send_count = s.recv_count = count;
      s.bytes = count * es;
      break;
    case kReduceScatter:
      count = bytes / es / n; /* per-rank block */
      if (count == 0) count = 1;
      s.send_count = count * n;
      s.recv_count = count;
      s.bytes = count * n * es;
      break;
    case kAllgather:
      count = bytes / es / n;
      if (count == 0) count = 1;
      s.send_count = count;
      s.recv_count = count * n;
      s.bytes = count * n * es;
      break;
    case kAlltoall:
      count = bytes / es / n; /* per rank pair */
      if (count == 0) count = 1;
      s.send_count = s.recv_count = count * n;
      s.bytes = count * n * es;
      break;
    case kAlltoallv:
      count = bytes / es; /* all a rank sends (and receives) */
      if (count == 0) count = 1;
      s.send_count = s.recv_count = count;
      s.bytes = count * es;
      break;
    case kBarrier:
      break;
  }
  return s;
}

static double BusFactor(enum Op op) {
  double n = (double)g_nranks;
  switch (op) {
    case kAllreduce: return 2.0 * (n - 1) / n;
    case kReduceScatter:
    case kAllgather:
    case kAlltoall:
    case kAlltoallv: return (n - 1) / n;
    case kBroadcast: return 1.0;
    default: return 0.0;
  }
}

/* Page-aligned buffer, every page written once so that no timed op pays a
 * first-touch fault. */
static void* AllocPrefaulted(size_t bytes) {
  if (bytes == 0) return NULL;
  void* p = NULL;
  if (posix_memalign(&p, 4096, bytes) != 0) Die("%s", "out of memory");
  memset(p, 0, bytes);
  return p;
}

static void FillInputs(const Options* o, const Shape* s, void* send, void* recv) {
  if (o->op == kBroadcast) {
    /* In place: root holds the data, the others a sentinel. */
    for (size_t i = 0; i < s->recv_count; ++i)
      Store(recv, o->dtype, i, g_rank == 0 ? FillValue(0, i) : -1000);
    return;
  }
  for (size_t i = 0; i < s->send_count; ++i) Store(send, o->dtype, i, FillValue(g_rank, i));
  for (size_t i = 0; i < s->recv_count; ++i) Store(recv, o->dtype, i, -1000);
}

static long long CountErrors(const Options* o, const Shape* s, const void* recv) {
  long long errors = 0;
  size_t block = s->send_count; /* allgather: elements per rank */
  /* alltoallv: where rank r's piece for this rank lies in its buffer
   * (from_at) and in this rank's (into); `from` walks the senders. */
  size_t* from_at = calloc((size_t)g_nranks, sizeof(size_t));
  size_t* into = calloc((size_t)g_nranks + 1, sizeof(size_t));
  int from = 0;
  for (int r = 0; o->op == kAlltoallv && r < g_nranks; ++r) {
    for (int j = 0; j < g_rank; ++j) from_at[r] += UnevenCount(s->send_count, r, j);
    into[r + 1] = into[r] + UnevenCount(s->send_count, r, g_rank);
  }
  for (size_t i = 0; i < s->recv_count; ++i) {
    int64_t want = 0;
    switch (o->op) {
      case kAllreduce: want = ExpectedSum(i); break;
      case kReduceScatter: want = ExpectedSum((size_t)g_rank * s->recv_count + i); break;
      case kAllgather: want = FillValue((int)(i / block), i % block); break;
      case kAlltoall: { /* block r from rank r's block for this rank */
        size_t pair = s->send_count / (size_t)g_nranks;
        want = FillValue((int)(i / pair), (size_t)g_rank * pair + i % pair);
        break;
      }
      case kAlltoallv: { /* the piece from rank `from`, in rank order */
        while (from + 1 < g_nranks && i >= into[from + 1]) ++from;
        want = FillValue(from, from_at[from] + i - into[from]);
        break;
      }
      case kBroadcast: want = FillValue(0, i); break;
      case kBarrier: break;
    }
    if (!Matches(recv, o->dtype, i, want)) ++errors;
  }
  free(from_at);
  free(into);
  return errors;
}

/* alltoallv's counts and displacements for this rank (RunSize sets them). */
static int* g_vcounts = NULL; /* send counts, send displs, recv counts, recv displs */

static void SetAlltoallvCounts(const Shape* s) {
  free(g_vcounts);
  g_vcounts = malloc(sizeof(int) * 4 * (size_t)g_nranks);
  int* sc = g_vcounts;
  int* sd = sc + g_nranks;
  int* rc = sd + g_nranks;
  int* rd = rc + g_nranks;
  for (int j = 0, sa = 0, ra = 0; j < g_nranks; ++j) {
    sc[j] = (int)UnevenCount(s->send_count, g_rank, j);
    rc[j] = (int)UnevenCount(s->send_count, j, g_rank);
    sd[j] = sa;
    rd[j] = ra;
    sa += sc[j];
    ra += rc[j];
  }
}

static void RunOp(const Options* o, const Shape* s, void* send, void* recv) {
  MPI_Datatype t = MpiType(o->dtype);
  switch (o->op) {
    case kAllreduce:
      MPI_Allreduce(send, recv, (int)s->send_count, t, MPI_SUM, MPI_COMM_WORLD);
      break;
    case kReduceScatter:
      MPI_Reduce_scatter_block(send, recv, (int)s->recv_count, t, MPI_SUM, MPI_COMM_WORLD);
      break;
    case kAllgather:
      MPI_Allgather(send, (int)s->send_count, t, recv, (int)s->send_count, t, MPI_COMM_WORLD);
      break;
    case kAlltoall:
      MPI_Alltoall(send, (int)(s->send_count / (size_t)g_nranks), t, recv,
                   (int)(s->send_count / (size_t)g_nranks), t, MPI_COMM_WORLD);
      break;
    case kAlltoallv: {
      int* v = g_vcounts;
      MPI_Alltoallv(send, v, v + g_nranks, t, recv, v + 2 * g_nranks, v + 3 * g_nranks, t,
                    MPI_COMM_WORLD);
      break;
    }
    case kBroadcast:
      MPI_Bcast(recv, (int)s->recv_count, t, 0, MPI_COMM_WORLD);
      break;
    case kBarrier:
      MPI_Barrier(MPI_COMM_WORLD);
      break;
  }
}

static int CompareDouble(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static double Median(double* v, int n) {
  qsort(v, (size_t)n, sizeof(double), CompareDouble);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The 99th percentile (nearest rank) of v, sorted ascending by Median. */
static double P99(const double* v, int n) {
  int k = (99 * n + 99) / 100; /* ceil(0.99 n) */
  return v[k < 1 ? 0 : k - 1];
}

static void PrintHeader(const Options* o) {
  if (g_rank != 0 || o->json) return;
  printf("# ciuic-mpi-bench: op %s, dtype %s, %d ranks, iters %d, warmup %d, check %s\n",
         kOpNames[o->op], kDtypeNames[o->dtype], g_nranks, o->iters, o->warmup,
         o->check ? "on" : "off");
  printf("# time: median over iters of the max over ranks; cold: first op of the size\n");
  printf("#\n");
  printf("# %10s %12s %8s %6s %5s %10s %10s %8s %8s %7s\n", "size", "count", "type", "redop",
         "root", "time", "cold", "algbw", "busbw", "#wrong");
  printf("# %10s %12s %8s %6s %5s %10s %10s %8s %8s %7s\n", "(B)", "(elements)", "", "", "",
         "(us)", "(us)", "(GB/s)", "(GB/s)", "");
  fflush(stdout);
}

static void PrintRow(const Options* o, const Shape* s, double time_us, double cold_us,
                     double p99_us, long long errors) {
  if (g_rank != 0) return;
  double algbw = time_us > 0 ? (double)s->bytes / (time_us * 1e3) : 0.0; /* 1e9 B/s */
  double busbw = algbw * BusFactor(o->op);
  if (o->json) {
    char err[32];
    if (errors < 0)
      snprintf(err, sizeof(err), "null");
    else
      snprintf(err, sizeof(err), "%lld", errors);
    printf("{\"op\": \"%s\", \"dtype\": \"%s\", \"bytes\": %zu, \"ranks\": %d, "
           "\"time_us\": %.3f, \"algbw_gbps\": %.6g, \"busbw_gbps\": %.6g, "
           "\"errors\": %s, \"cold_us\": %.3f, \"p99_us\": %.3f}\n",
           kOpNames[o->op], kDtypeNames[o->dtype], s->bytes, g_nranks, time_us, algbw, busbw,
           err, cold_us, p99_us);
  } else {
    size_t count = o->op == kAllgather ? s->recv_count : s->send_count;
    char err[32];
    if (errors < 0)
      snprintf(err, sizeof(err), "N/A");
    else
      snprintf(err, sizeof(err), "%lld", errors);
    const char* redop = (o->op == kAllreduce || o->op == kReduceScatter) ? "sum" : "none";
    int root = o->op == kBroadcast ? 0 : -1;
    printf("  %10zu %12zu %8s %6s %5d %10.2f %10.2f %8.3f %8.3f %7s\n", s->bytes, count,
           kDtypeNames[o->dtype], redop, root, time_us, cold_us, algbw, busbw, err);
  }
  fflush(stdout);
}

static void RunSize(const Options* o, size_t requested_bytes) {
  Shape s = ShapeFor(o->op, o->dtype, requested_bytes);
  size_t es = DtypeSize(o->dtype);
  void* send = o->op == kBroadcast ? NULL : AllocPrefaulted(s.send_count * es);
  void* recv = AllocPrefaulted(s.recv_count * es);
  FillInputs(o, &s, send, recv);
  if (o->op == kAlltoallv) SetAlltoallvCounts(&s);

  double* times = malloc(sizeof(double) * (size_t)o->iters);
  double* max_times = malloc(sizeof(double) * (size_t)o->iters);

  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  RunOp(o, &s, send, recv);
  double cold = MPI_Wtime() - t0;
  for (int i = 0; i < o->warmup; ++i) RunOp(o, &s, send, recv);
  MPI_Barrier(MPI_COMM_WORLD);
  for (int i = 0; i < o->iters; ++i) {
    t0 = MPI_Wtime();
    RunOp(o, &s, send, recv);
    times[i] = MPI_Wtime() - t0;
  }
  double cold_max = 0;
  MPI_Reduce(&cold, &cold_max, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  MPI_Reduce(times, max_times, o->iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

  long long errors = -1;
  if (o->check && o->op != kBarrier) {
    FillInputs(o, &s, send, recv);
    MPI_Barrier(MPI_COMM_WORLD);
    RunOp(o, &s, send, recv);
    long long mine = CountErrors(o, &s, recv), total = 0;
    MPI_Reduce(&mine, &total, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    errors = total;
  } else if (o->check) {
    errors = 0;
  }

  double median_us = g_rank == 0 ? Median(max_times, o->iters) * 1e6 : 0;
  double p99_us = g_rank == 0 ? P99(max_times, o->iters) * 1e6 : 0;
  PrintRow(o, &s, median_us, cold_max * 1e6, p99_us, errors);

  free(times);
  free(max_times);
  free(send);
  free(recv);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_nranks);
  Options opt;
  ParseArgs(argc, argv, &opt);
  for (int k = 0; k < opt.num_sizes; ++k) {
    Shape s = ShapeFor(opt.op, opt.dtype, opt.sizes[k]);
    size_t elems = s.send_count > s.recv_count ? s.send_count : s.recv_count;
    if (elems > (size_t)INT_MAX) Die("%s", "a size exceeds INT_MAX elements");
  }
  PrintHeader(&opt);
  if (opt.op == kBarrier) {
    RunSize(&opt, 0); /* one row: sizes mean nothing to a barrier */
  } else {
    for (int k = 0; k < opt.num_sizes; ++k) RunSize(&opt, opt.sizes[k]);
  }
  MPI_Finalize();
  return 0;
}
