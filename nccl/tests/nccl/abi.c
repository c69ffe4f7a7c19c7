/* The C side of oxccl-nccl's tests: built against include/nccl.h and linked with the library
 * through its SONAME (libnccl.so.2), it checks what needs no GPU. Prints one line per check and
 * "ALL OK" at the end; exits 1 at the first failure, saying what failed. */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl.h"

#define CHECK(cond, ...)                                           \
  do {                                                             \
    if (!(cond)) {                                                 \
      printf("FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond);     \
      printf(__VA_ARGS__);                                         \
      printf(" (last error: %s)\n", ncclGetLastError(NULL));       \
      exit(1);                                                     \
    }                                                              \
  } while (0)

#define OK(call) CHECK((call) == ncclSuccess, "%s", #call)

/* Every public function of NCCL 2.30: nccl.h, then the host functions of nccl_device.h. */
static const char *NAMES[] = {
    "ncclMemAlloc", "ncclMemFree", "ncclGetVersion", "ncclGetUniqueId",
    "ncclCommInitRankConfig", "ncclCommInitRank", "ncclCommInitAll", "ncclCommFinalize",
    "ncclCommDestroy", "ncclCommAbort", "ncclCommRevoke", "ncclCommSplit", "ncclCommShrink",
    "ncclCommGetUniqueId", "ncclCommGrow", "ncclCommInitRankScalable", "ncclGetErrorString",
    "ncclGetLastError", "ncclResetDebugInit", "ncclCommGetAsyncError", "ncclCommCount",
    "ncclCommCuDevice", "ncclCommUserRank", "ncclCommRegister", "ncclCommDeregister",
    "ncclCommSuspend", "ncclCommResume", "ncclCommMemStats", "ncclCommWindowRegister",
    "ncclCommWindowDeregister", "ncclWinGetUserPtr", "ncclRedOpCreatePreMulSum",
    "ncclRedOpDestroy", "ncclReduce", "ncclBcast", "ncclBroadcast", "ncclAllReduce",
    "ncclReduceScatter", "ncclAllGather", "ncclAlltoAll", "ncclGather", "ncclScatter",
    "ncclSend", "ncclRecv", "ncclPutSignal", "ncclSignal", "ncclWaitSignal", "ncclGroupStart",
    "ncclGroupEnd", "ncclGroupSimulateEnd", "ncclParamBind", "ncclParamGetI8",
    "ncclParamGetI16", "ncclParamGetI32", "ncclParamGetI64", "ncclParamGetU8",
    "ncclParamGetU16", "ncclParamGetU32", "ncclParamGetU64", "ncclParamGetStr",
    "ncclParamGet", "ncclParamGetParameter", "ncclParamGetAllParameterKeys",
    "ncclParamDumpAll",
    /* nccl_device.h's host side */
    "ncclCommQueryProperties", "ncclDevCommCreate", "ncclDevCommDestroy",
    "ncclGetLsaDevicePointer", "ncclGetLsaMultimemDevicePointer",
    "ncclGetMultimemDevicePointer", "ncclGetPeerDevicePointer",
    "ncclGinBarrierCreateRequirement", "ncclGinInboxA2ACreateRequirement",
    "ncclGinOutboxCreateRequirement", "ncclLLA2ACalcSlots", "ncclLLA2ACreateRequirement",
    "ncclLsaBarrierCreateRequirement", "ncclTeamLsa", "ncclTeamRail", "ncclTeamRankToLsa",
    "ncclTeamRankToWorld", "ncclTeamWorld"};

static void check_exports(void) {
  size_t n = sizeof(NAMES) / sizeof(NAMES[0]);
  for (size_t i = 0; i < n; i++) {
    char p[128];
    snprintf(p, sizeof p, "p%s", NAMES[i]);
    CHECK(dlsym(RTLD_DEFAULT, NAMES[i]) != NULL, "%s is not exported", NAMES[i]);
    CHECK(dlsym(RTLD_DEFAULT, p) != NULL, "%s is not exported", p);
  }
  printf("exports: %zu functions and their p twins\n", n);
}

static void check_version_and_strings(void) {
  int v = 0;
  OK(ncclGetVersion(&v));
  CHECK(v == NCCL_VERSION(2, 30, 0), "version %d", v);
  CHECK(ncclGetVersion(NULL) == ncclInvalidArgument, "NULL version");
  CHECK(strstr(ncclGetLastError(NULL), "ncclGetVersion") != NULL, "last error names the call");
  for (int r = ncclSuccess; r < ncclNumResults; r++) {
    const char *s = ncclGetErrorString((ncclResult_t)r);
    CHECK(s != NULL && strlen(s) > 0, "error string of %d", r);
    for (int q = ncclSuccess; q < r; q++)
      CHECK(strcmp(s, ncclGetErrorString((ncclResult_t)q)) != 0, "strings %d and %d", q, r);
  }
  CHECK(ncclGetErrorString((ncclResult_t)1234) != NULL, "unknown code");
  printf("version %d and error strings\n", v);
}

struct rank_arg {
  ncclUniqueId id;
  int rank, nranks;
  ncclConfig_t *config;
  ncclComm_t comm;
  ncclResult_t res;
};

static void *init_rank(void *p) {
  struct rank_arg *a = p;
  a->res = a->config ? ncclCommInitRankConfig(&a->comm, a->nranks, a->id, a->rank, a->config)
                     : ncclCommInitRank(&a->comm, a->nranks, a->id, a->rank);
  return NULL;
}

/* `n` ranks of a fresh id, one thread each, each with `configs[r]` (or none). */
static void init_threads(int n, ncclComm_t *comms, ncclConfig_t **configs) {
  ncclUniqueId id;
  OK(ncclGetUniqueId(&id));
  struct rank_arg args[8];
  pthread_t t[8];
  for (int r = 0; r < n; r++) {
    args[r] = (struct rank_arg){id, r, n, configs ? configs[r] : NULL, NULL, ncclInternalError};
    CHECK(pthread_create(&t[r], NULL, init_rank, &args[r]) == 0, "thread");
  }
  for (int r = 0; r < n; r++) {
    pthread_join(t[r], NULL);
    CHECK(args[r].res == ncclSuccess, "rank %d init: %d", r, args[r].res);
    comms[r] = args[r].comm;
  }
}

static void check_comm(ncclComm_t c, int rank, int n) {
  int v = -1;
  OK(ncclCommCount(c, &v));
  CHECK(v == n, "count %d", v);
  OK(ncclCommUserRank(c, &v));
  CHECK(v == rank, "rank %d", v);
  OK(ncclCommCuDevice(c, &v));
  ncclResult_t e = ncclInternalError;
  OK(ncclCommGetAsyncError(c, &e));
  CHECK(e == ncclSuccess, "async error %d", e);
}

static void check_unique_ids_and_threads(void) {
  ncclUniqueId a, b;
  OK(ncclGetUniqueId(&a));
  OK(ncclGetUniqueId(&b));
  CHECK(memcmp(&a, &b, sizeof a) != 0, "two ids are equal");
  ncclComm_t comms[3];
  init_threads(3, comms, NULL);
  for (int r = 0; r < 3; r++) check_comm(comms[r], r, 3);
  for (int r = 0; r < 3; r++) OK(ncclCommDestroy(comms[r]));
  ncclUniqueId zero;
  memset(&zero, 0, sizeof zero);
  ncclComm_t c = NULL;
  CHECK(ncclCommInitRank(&c, 2, zero, 0) == ncclInvalidArgument, "a foreign id");
  CHECK(strstr(ncclGetLastError(NULL), "not made by oxccl") != NULL, "the text says why");
  CHECK(ncclCommInitRank(&c, 2, a, 2) == ncclInvalidArgument, "rank 2 of 2");
  CHECK(ncclCommInitRank(NULL, 2, a, 0) == ncclInvalidArgument, "NULL comm");
  printf("unique ids, 3 ranks as threads, bad init arguments\n");
}

static void check_group_init(void) {
  CHECK(ncclGroupEnd() == ncclInvalidUsage, "end without start");
  ncclUniqueId id;
  OK(ncclGetUniqueId(&id));
  ncclComm_t comms[4];
  int v;
  /* One thread creates every rank inside a group (nccl-tests -g): without deferral to
   * ncclGroupEnd the first init would wait for the others for ever. */
  OK(ncclGroupStart());
  OK(ncclGroupStart());
  for (int r = 0; r < 4; r++) OK(ncclCommInitRank(&comms[r], 4, id, r));
  OK(ncclGroupEnd());
  CHECK(ncclCommCount(comms[0], &v) == ncclInvalidUsage, "used before the outer end");
  OK(ncclGroupEnd());
  for (int r = 0; r < 4; r++) check_comm(comms[r], r, 4);
  /* Split inside a group: colors by parity, rank 3 out. */
  ncclComm_t sub[4];
  OK(ncclGroupStart());
  for (int r = 0; r < 4; r++)
    OK(ncclCommSplit(comms[r], r == 3 ? NCCL_SPLIT_NOCOLOR : r % 2, -r, &sub[r], NULL));
  OK(ncclGroupEnd());
  CHECK(sub[3] == NULL, "a rank without color gets NULL");
  /* ranks 0 and 2 (keys 0 and -2: rank 2 first), rank 1 alone */
  check_comm(sub[2], 0, 2);
  check_comm(sub[0], 1, 2);
  check_comm(sub[1], 0, 1);
  for (int r = 0; r < 3; r++) OK(ncclCommDestroy(sub[r]));
  for (int r = 0; r < 4; r++) OK(ncclCommFinalize(comms[r]));
  for (int r = 0; r < 4; r++) OK(ncclCommDestroy(comms[r]));
  ncclComm_t all[3];
  OK(ncclCommInitAll(all, 3, NULL));
  for (int r = 0; r < 3; r++) check_comm(all[r], r, 3);
  for (int r = 0; r < 3; r++) OK(ncclCommAbort(all[r]));
  printf("group init (4 ranks, one thread), split in a group, ncclCommInitAll, abort\n");
}

/* A config as a caller built against an older header has it: only the fields up to netName. */
struct old_config {
  size_t size;
  unsigned int magic, version;
  int blocking, cgaClusterSize, minCTAs, maxCTAs;
  const char *netName;
};

/* ... and one from a newer header, with fields this library does not know. */
struct new_config {
  ncclConfig_t base;
  int future1, future2;
};

static void check_configs(void) {
  ncclConfig_t cur = NCCL_CONFIG_INITIALIZER;
  cur.blocking = 1;
  struct old_config old = {sizeof(struct old_config), NCCL_API_MAGIC, NCCL_VERSION(2, 14, 0),
                           1, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,
                           NCCL_CONFIG_UNDEF_INT, NULL};
  struct new_config newer = {NCCL_CONFIG_INITIALIZER, 7, 8};
  newer.base.size = sizeof newer;
  ncclConfig_t *configs[3] = {&cur, (ncclConfig_t *)&old, &newer.base};
  ncclComm_t comms[3];
  init_threads(3, comms, configs);
  for (int r = 0; r < 3; r++) check_comm(comms[r], r, 3);
  for (int r = 0; r < 3; r++) OK(ncclCommDestroy(comms[r]));
  ncclUniqueId id;
  OK(ncclGetUniqueId(&id));
  ncclComm_t c;
  ncclConfig_t bad = NCCL_CONFIG_INITIALIZER;
  bad.magic = 0x1234;
  CHECK(ncclCommInitRankConfig(&c, 1, id, 0, &bad) == ncclInvalidArgument, "bad magic");
  CHECK(strstr(ncclGetLastError(NULL), "magic") != NULL, "the text names the magic");
  bad = (ncclConfig_t)NCCL_CONFIG_INITIALIZER;
  bad.size = 4;
  CHECK(ncclCommInitRankConfig(&c, 1, id, 0, &bad) == ncclInvalidArgument, "tiny size");
  printf("configs: current, older (%zu bytes) and newer (%zu bytes) headers; bad ones refused\n",
         sizeof old, sizeof newer);
}

/* Polls ncclCommGetAsyncError until the creation of `c` ended (bounded); its result. */
static ncclResult_t wait_created(ncclComm_t c) {
  ncclResult_t e = ncclInProgress;
  struct timespec ms = {0, 1000 * 1000};
  for (int i = 0; i < 120000 && e == ncclInProgress; i++) {
    OK(ncclCommGetAsyncError(c, &e));
    if (e == ncclInProgress) nanosleep(&ms, NULL);
  }
  return e;
}

static void check_nonblocking(void) {
  ncclUniqueId id;
  OK(ncclGetUniqueId(&id));
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comms[3];
  /* One thread, no group: blocking, the first init would wait for the others for ever. */
  for (int r = 0; r < 3; r++) {
    ncclResult_t res = ncclCommInitRankConfig(&comms[r], 3, id, r, &cfg);
    CHECK(res == ncclInProgress, "rank %d: non-blocking init returned %d", r, res);
  }
  /* A call on one still being created waits for it. */
  int v = -1;
  OK(ncclCommCount(comms[1], &v));
  CHECK(v == 3, "count %d", v);
  for (int r = 0; r < 3; r++) CHECK(wait_created(comms[r]) == ncclSuccess, "rank %d", r);
  for (int r = 0; r < 3; r++) check_comm(comms[r], r, 3);
  /* A split with no config inherits non-blocking (rank 2 without color: NULL). */
  ncclComm_t sub[3];
  for (int r = 0; r < 3; r++) {
    ncclResult_t res = ncclCommSplit(comms[r], r == 2 ? NCCL_SPLIT_NOCOLOR : 0, r, &sub[r], NULL);
    CHECK(res == ncclInProgress, "rank %d: split returned %d", r, res);
  }
  CHECK(sub[2] == NULL, "a rank without color gets NULL");
  for (int r = 0; r < 2; r++) {
    CHECK(wait_created(sub[r]) == ncclSuccess, "split rank %d", r);
    check_comm(sub[r], r, 2);
  }
  /* A config that says blocking = 1 makes the split block (a group lets one thread do it). */
  ncclConfig_t blocking = NCCL_CONFIG_INITIALIZER;
  blocking.blocking = 1;
  ncclComm_t again[3];
  OK(ncclGroupStart());
  for (int r = 0; r < 3; r++) OK(ncclCommSplit(comms[r], 0, r, &again[r], &blocking));
  OK(ncclGroupEnd());
  for (int r = 0; r < 3; r++) check_comm(again[r], r, 3);
  for (int r = 0; r < 3; r++) OK(ncclCommDestroy(again[r]));
  for (int r = 0; r < 2; r++) OK(ncclCommDestroy(sub[r]));
  for (int r = 0; r < 3; r++) OK(ncclCommDestroy(comms[r]));
  /* Bad arguments fail at the call, non-blocking or not. */
  ncclComm_t lone;
  memset(&id, 0, sizeof id);
  CHECK(ncclCommInitRankConfig(&lone, 2, id, 0, &cfg) == ncclInvalidArgument, "foreign id");
  printf("non-blocking: 3 ranks and a split from one thread (ncclInProgress, then polled)\n");
}

static void check_calls_without_device(void) {
  ncclComm_t c;
  OK(ncclCommInitAll(&c, 1, NULL));
  CHECK(ncclCommRevoke(c, 0) == ncclInvalidUsage, "revoke");
  CHECK(strstr(ncclGetLastError(c), "ncclCommRevoke") != NULL, "names the function");
  ncclComm_t s;
  int bad_rank = 5;
  CHECK(ncclCommShrink(c, &bad_rank, 1, &s, NULL, 0) != ncclSuccess, "shrink excluding rank 5 of 1");
  CHECK(ncclAllReduce(NULL, NULL, 0, (ncclDataType_t)99, ncclSum, c, NULL) == ncclInvalidArgument,
        "dtype 99");
  CHECK(ncclBroadcast(NULL, NULL, 0, ncclFloat, 1, c, NULL) == ncclInvalidArgument, "root 1 of 1");
  CHECK(ncclAllReduce(NULL, NULL, 0, ncclFloat, (ncclRedOp_t)77, c, NULL) == ncclInvalidArgument,
        "op 77");
  ncclRedOp_t op;
  float scalar = 0.5f;
  OK(ncclRedOpCreatePreMulSum(&op, &scalar, ncclFloat, ncclScalarHostImmediate, c));
  CHECK(op >= ncclNumOps, "a created op %d", (int)op);
  CHECK(ncclRedOpCreatePreMulSum(&op, &scalar, ncclFloat, ncclScalarDevice, c) ==
            ncclInvalidUsage, "device scalar");
  OK(ncclRedOpDestroy(op, c));
  CHECK(ncclRedOpDestroy(op, c) == ncclInvalidArgument, "destroyed twice");
  void *h = NULL;
  int x;
  OK(ncclCommRegister(c, &x, sizeof x, &h));
  OK(ncclCommDeregister(c, h));
  OK(ncclGroupStart());
  OK(ncclAllReduce(&x, &x, 1, ncclInt, ncclSum, c, NULL)); /* deferred */
  ncclResult_t end = ncclGroupEnd();
  const char *why = ncclGetLastError(NULL);
  if (end == ncclInvalidUsage && strstr(why, "without") != NULL) {
    printf("collectives: no device support in this build (%s)\n", why);
  } else if (strstr(why, "no CUDA driver") != NULL) {
    /* the `cuda` feature on a machine without a CUDA driver */
    CHECK(end == ncclUnhandledCudaError, "group end %d", end);
    printf("collectives: the cuda feature, no driver here (%s)\n", why);
  } else {
    /* with a driver: a host address where device memory belongs is refused by CUDA */
    CHECK(end == ncclUnhandledCudaError || end == ncclInvalidArgument, "group end %d (%s)", end,
          why);
    printf("collectives: host memory given as device memory refused (%s)\n", why);
  }
  CHECK(ncclCommCount(NULL, &x) == ncclInvalidArgument, "NULL comm");
  OK(ncclCommDestroy(c));
  printf("calls that need no device: not implemented, bad arguments, ops, registration\n");
}

/* ---- OXCCL_NCCL_HOST_MEMORY=1: every call on host buffers, results checked ---- */

#define N 3
#define COUNT 1000

struct host_rank {
  ncclComm_t comm;
  int rank;
};

static void *host_collectives(void *p) {
  struct host_rank *a = p;
  ncclComm_t c = a->comm;
  int me = a->rank;
  float in[COUNT * N], out[COUNT * N];
  for (int i = 0; i < COUNT; i++) in[i] = (float)(me + i);
  OK(ncclAllReduce(in, out, COUNT, ncclFloat, ncclSum, c, NULL));
  for (int i = 0; i < COUNT; i++) CHECK(out[i] == (float)(3 * i + 3), "sum [%d] = %g", i, out[i]);
  OK(ncclAllReduce(in, in, COUNT, ncclFloat, ncclAvg, c, NULL));
  for (int i = 0; i < COUNT; i++) CHECK(in[i] == (float)(i + 1), "avg in place [%d] = %g", i, in[i]);
  int m = me * 7;
  OK(ncclAllReduce(&m, &m, 1, ncclInt32, ncclMax, c, NULL));
  CHECK(m == 14, "max %d", m);
  /* 16-bit and 8-bit floats: 1.0 from every rank sums to 3.0 */
  uint16_t h = 0x3C00, bf = 0x3F80;
  uint8_t e4 = 0x38, e5 = 0x3C;
  OK(ncclAllReduce(&h, &h, 1, ncclFloat16, ncclSum, c, NULL));
  OK(ncclAllReduce(&bf, &bf, 1, ncclBfloat16, ncclSum, c, NULL));
  OK(ncclAllReduce(&e4, &e4, 1, ncclFloat8e4m3, ncclSum, c, NULL));
  OK(ncclAllReduce(&e5, &e5, 1, ncclFloat8e5m2, ncclSum, c, NULL));
  CHECK(h == 0x4200 && bf == 0x4040 && e4 == 0x44 && e5 == 0x42, "%x %x %x %x", h, bf, e4, e5);
  int64_t l = (int64_t)1 << 40;
  uint8_t u = 200;
  double d = 0.25;
  OK(ncclAllReduce(&l, &l, 1, ncclInt64, ncclSum, c, NULL));
  OK(ncclAllReduce(&u, &u, 1, ncclUint8, ncclMin, c, NULL));
  OK(ncclAllReduce(&d, &d, 1, ncclDouble, ncclProd, c, NULL));
  CHECK(l == 3 * ((int64_t)1 << 40) && u == 200 && d == 0.25 * 0.25 * 0.25, "i64 u8 f64");
  /* premul-sum: each rank scales its own 1.0 by rank + 1 */
  ncclRedOp_t pre;
  float factor = (float)(me + 1), one = 1.0f;
  OK(ncclRedOpCreatePreMulSum(&pre, &factor, ncclFloat, ncclScalarHostImmediate, c));
  OK(ncclAllReduce(&one, &one, 1, ncclFloat, pre, c, NULL));
  OK(ncclRedOpDestroy(pre, c));
  CHECK(one == 6.0f, "premul %g", one);
  /* broadcast out of place from 1, in place from 2 */
  int b[4] = {me, me, me, me}, bo[4] = {0};
  OK(ncclBroadcast(b, bo, 4, ncclInt, 1, c, NULL));
  OK(ncclBcast(b, 4, ncclInt, 2, c, NULL));
  CHECK(bo[3] == 1 && b[0] == 2, "broadcast %d %d", bo[3], b[0]);
  /* reduce to 0, out of place, then in place on the root */
  int r = me + 1, ro = -1;
  OK(ncclReduce(&r, &ro, 1, ncclInt, ncclSum, 0, c, NULL));
  if (me == 0) CHECK(ro == 6, "reduce %d", ro);
  OK(ncclReduce(&r, &r, 1, ncclInt, ncclProd, 0, c, NULL));
  if (me == 0) CHECK(r == 6, "reduce in place %d", r);
  /* all-gather, reduce-scatter, all-to-all */
  int32_t g[5], ga[5 * N];
  for (int i = 0; i < 5; i++) g[i] = me * 100 + i;
  OK(ncclAllGather(g, ga, 5, ncclInt32, c, NULL));
  for (int i = 0; i < 5 * N; i++) CHECK(ga[i] == (i / 5) * 100 + i % 5, "all-gather [%d]", i);
  int32_t rs_in[4 * N], rs_out[4];
  for (int i = 0; i < 4 * N; i++) rs_in[i] = me + i;
  OK(ncclReduceScatter(rs_in, rs_out, 4, ncclInt32, ncclSum, c, NULL));
  for (int i = 0; i < 4; i++) CHECK(rs_out[i] == 3 + 3 * (me * 4 + i), "reduce-scatter [%d]", i);
  int32_t a2a_in[4 * N], a2a_out[4 * N];
  for (int q = 0; q < N; q++)
    for (int i = 0; i < 4; i++) a2a_in[q * 4 + i] = me * 1000 + q * 10 + i;
  OK(ncclAlltoAll(a2a_in, a2a_out, 4, ncclInt32, c, NULL));
  for (int q = 0; q < N; q++)
    for (int i = 0; i < 4; i++)
      CHECK(a2a_out[q * 4 + i] == q * 1000 + me * 10 + i, "all-to-all [%d]", q * 4 + i);
  /* gather to 2, scatter from 0 */
  int32_t gv = me * 3, gat[N] = {-1, -1, -1};
  OK(ncclGather(&gv, gat, 1, ncclInt32, 2, c, NULL));
  if (me == 2) CHECK(gat[0] == 0 && gat[1] == 3 && gat[2] == 6, "gather");
  int32_t sc[N] = {10, 11, 12}, sv = -1;
  OK(ncclScatter(sc, &sv, 1, ncclInt32, 0, c, NULL));
  CHECK(sv == 10 + me, "scatter %d", sv);
  /* grouped sends and receives in a ring, both ways, 4 MiB each (far more than the rings of
   * shared memory hold: called one after the other, the sends would wait for ever), one of
   * them in another data type */
  int next = (me + 1) % N, prev = (me + N - 1) % N;
  size_t big = 1 << 20;
  float *to_next = malloc(big * 4), *from_prev = malloc(big * 4);
  int32_t *to_prev = malloc(big * 4), *from_next = malloc(big * 4);
  for (size_t i = 0; i < big; i++) {
    to_next[i] = (float)(me * 10);
    to_prev[i] = me * 100 + 1;
  }
  OK(ncclGroupStart());
  OK(ncclSend(to_next, big, ncclFloat, next, c, NULL));
  OK(ncclSend(to_prev, big, ncclInt32, prev, c, NULL));
  OK(ncclRecv(from_prev, big, ncclFloat, prev, c, NULL));
  OK(ncclRecv(from_next, big, ncclInt32, next, c, NULL));
  OK(ncclGroupEnd());
  CHECK(from_prev[big - 1] == (float)(prev * 10) && from_next[0] == next * 100 + 1, "ring");
  free(to_next), free(from_prev), free(to_prev), free(from_next);
  /* an ungrouped pair: 0 sends to 1 */
  int one_msg = 42;
  if (me == 0) OK(ncclSend(&one_msg, 1, ncclInt, 1, c, NULL));
  if (me == 1) {
    one_msg = 0;
    OK(ncclRecv(&one_msg, 1, ncclInt, 0, c, NULL));
    CHECK(one_msg == 42, "recv %d", one_msg);
  }
  /* a receive that expects more than was sent is an error naming both, not a hang (the
   * send itself completes: it fits the receiver's ring) */
  if (me < 2) {
    int x[2] = {0, 0};
    ncclResult_t res = me == 0 ? ncclSend(x, 1, ncclInt, 1, c, NULL)
                               : ncclRecv(x, 2, ncclInt, 0, c, NULL);
    if (me == 1) {
      CHECK(res != ncclSuccess, "a send of 1 received as 2");
      CHECK(strstr(ncclGetLastError(c), "rank 0") != NULL, "names the sender");
    }
  }
  return NULL;
}

static void *shrink_rank(void *p) {
  struct host_rank *a = p;
  int gone = 2, one = 1;
  ncclComm_t s = NULL;
  OK(ncclCommShrink(a->comm, &gone, 1, &s, NULL, 0));
  check_comm(s, a->rank, 2);
  OK(ncclAllReduce(&one, &one, 1, ncclInt, ncclSum, s, NULL));
  CHECK(one == 2, "all-reduce after shrink: %d", one);
  OK(ncclCommDestroy(s));
  return NULL;
}

struct blocked {
  ncclComm_t comm;
  ncclResult_t res;
};

static void *blocked_all_reduce(void *p) {
  struct blocked *b = p;
  float x = 1.0f;
  b->res = ncclAllReduce(&x, &x, 1, ncclFloat, ncclSum, b->comm, NULL);
  return NULL;
}

static void check_host_memory(void) {
  ncclComm_t comms[N];
  init_threads(N, comms, NULL);
  struct host_rank args[N];
  pthread_t t[N];
  for (int r = 0; r < N; r++) {
    args[r] = (struct host_rank){comms[r], r};
    CHECK(pthread_create(&t[r], NULL, host_collectives, &args[r]) == 0, "thread");
  }
  for (int r = 0; r < N; r++) pthread_join(t[r], NULL);
  for (int r = 0; r < N; r++) OK(ncclCommDestroy(comms[r]));
  printf("host memory: every collective, 10 data types, premul-sum, grouped ring of 4 MiB\n");
  /* ranks 0 and 1 shrink rank 2 away (it does not call) */
  init_threads(N, comms, NULL);
  for (int r = 0; r < 2; r++) {
    args[r] = (struct host_rank){comms[r], r};
    CHECK(pthread_create(&t[r], NULL, shrink_rank, &args[r]) == 0, "thread");
  }
  for (int r = 0; r < 2; r++) pthread_join(t[r], NULL);
  for (int r = 0; r < N; r++) OK(ncclCommDestroy(comms[r]));
  printf("shrink: ranks 0 and 1 without rank 2, then an all-reduce on them\n");
  /* abort from another thread wakes a call that waits for a rank that never comes */
  ncclComm_t two[2];
  OK(ncclCommInitAll(two, 2, NULL));
  struct blocked b = {two[0], ncclSuccess};
  pthread_t bt;
  CHECK(pthread_create(&bt, NULL, blocked_all_reduce, &b) == 0, "thread");
  struct timespec wait = {0, 300 * 1000 * 1000};
  nanosleep(&wait, NULL);
  OK(ncclCommAbort(two[0]));
  pthread_join(bt, NULL);
  CHECK(b.res != ncclSuccess, "the blocked call ended with success");
  printf("abort from another thread ended a blocked all-reduce: %s\n", ncclGetLastError(NULL));
  OK(ncclCommDestroy(two[1]));
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "host") == 0) {
    check_host_memory();
    printf("ALL OK\n");
    return 0;
  }
  check_exports();
  check_version_and_strings();
  check_unique_ids_and_threads();
  check_group_init();
  check_configs();
  check_nonblocking();
  check_calls_without_device();
  printf("ALL OK\n");
  return 0;
}
