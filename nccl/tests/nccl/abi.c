/* The C side of oxccl-nccl's tests: built against include/nccl.h and linked with the library
 * through its SONAME (libnccl.so.2), it checks what needs no GPU. Prints one line per check and
 * "ALL OK" at the end; exits 1 at the first failure, saying what failed. */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static void check_calls_without_device(void) {
  ncclComm_t c;
  OK(ncclCommInitAll(&c, 1, NULL));
  CHECK(ncclCommShrink(c, NULL, 0, NULL, NULL, 0) == ncclInvalidUsage, "shrink");
  CHECK(strstr(ncclGetLastError(c), "ncclCommShrink") != NULL, "names the function");
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
  } else {
    /* the `cuda` feature on a machine without a CUDA driver */
    CHECK(end == ncclUnhandledCudaError && strstr(why, "no CUDA driver") != NULL,
          "group end %d", end);
    printf("collectives: the cuda feature, no driver here (%s)\n", why);
  }
  CHECK(ncclCommCount(NULL, &x) == ncclInvalidArgument, "NULL comm");
  OK(ncclCommDestroy(c));
  printf("calls that need no device: not implemented, bad arguments, ops, registration\n");
}

int main(void) {
  check_exports();
  check_version_and_strings();
  check_unique_ids_and_threads();
  check_group_init();
  check_configs();
  check_calls_without_device();
  printf("ALL OK\n");
  return 0;
}
