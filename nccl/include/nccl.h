/* oxccl's declaration of NCCL 2.30's C API (the ABI of libnccl.so.2), for programs and tests
 * built against oxccl-nccl. Types and values match NCCL's; every function is also exported
 * with a `p` prefix (pncclAllReduce, ...). docs/NCCL.md says what is implemented. */
#ifndef OXCCL_NCCL_H
#define OXCCL_NCCL_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#ifndef __CUDA_RUNTIME_H__
typedef struct CUstream_st *cudaStream_t;
#endif

#define NCCL_MAJOR 2
#define NCCL_MINOR 30
#define NCCL_PATCH 0
#define NCCL_SUFFIX ""
#define NCCL_VERSION_CODE 23000
#define NCCL_VERSION(X, Y, Z) \
  (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ncclComm *ncclComm_t;
typedef struct ncclWindow_vidmem *ncclWindow_t;
#define NCCL_COMM_NULL NULL

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclTimeout = 8,
  ncclNumResults = 9
} ncclResult_t;

#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL
#define NCCL_SPLIT_NOCOLOR -1
#define NCCL_UNDEF_FLOAT -1.0f
#define NCCL_API_MAGIC 0xcafebeef

typedef struct ncclConfig_v23000 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
  int trafficClass;
  const char *commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
  int graphUsageMode;
  int numRmaCtx;
  int maxP2pPeers;
  int graphStreamOrdering;
} ncclConfig_t;

#define NCCL_CONFIG_INITIALIZER                                                             \
  {sizeof(ncclConfig_t), NCCL_API_MAGIC, NCCL_VERSION_CODE, NCCL_CONFIG_UNDEF_INT,          \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,                     \
   NCCL_CONFIG_UNDEF_PTR, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,                     \
   NCCL_CONFIG_UNDEF_PTR, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,                     \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,                     \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,                     \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT}

typedef struct ncclSimInfo_v22200 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  float estimatedTime;
} ncclSimInfo_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5,
               ncclMaxRedOp = 0x7fffffff } ncclRedOp_t;

typedef enum {
  ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclInt32 = 2, ncclInt = 2, ncclUint32 = 3,
  ncclInt64 = 4, ncclUint64 = 5, ncclFloat16 = 6, ncclHalf = 6, ncclFloat32 = 7, ncclFloat = 7,
  ncclFloat64 = 8, ncclDouble = 8, ncclBfloat16 = 9, ncclFloat8e4m3 = 10, ncclFloat8e5m2 = 11,
  ncclNumTypes = 12
} ncclDataType_t;

typedef enum { ncclScalarDevice = 0, ncclScalarHostImmediate = 1 } ncclScalarResidence_t;

typedef enum {
  ncclStatGpuMemSuspend = 0, ncclStatGpuMemSuspended = 1, ncclStatGpuMemPersist = 2,
  ncclStatGpuMemTotal = 3
} ncclCommMemStat_t;

typedef struct {
  int opCnt;
  int peer;
  int sigIdx;
  int ctx;
} ncclWaitSignalDesc_t;

typedef struct ncclParamHandle *ncclParamHandle_t;

#define OXCCL_NCCL_API(ret, name, args) ret name args; ret p##name args;

OXCCL_NCCL_API(ncclResult_t, ncclMemAlloc, (void **ptr, size_t size))
OXCCL_NCCL_API(ncclResult_t, ncclMemFree, (void *ptr))
OXCCL_NCCL_API(ncclResult_t, ncclGetVersion, (int *version))
OXCCL_NCCL_API(ncclResult_t, ncclGetUniqueId, (ncclUniqueId *uniqueId))
OXCCL_NCCL_API(ncclResult_t, ncclCommInitRankConfig,
               (ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config))
OXCCL_NCCL_API(ncclResult_t, ncclCommInitRank,
               (ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank))
OXCCL_NCCL_API(ncclResult_t, ncclCommInitAll, (ncclComm_t *comm, int ndev, const int *devlist))
OXCCL_NCCL_API(ncclResult_t, ncclCommFinalize, (ncclComm_t comm))
OXCCL_NCCL_API(ncclResult_t, ncclCommDestroy, (ncclComm_t comm))
OXCCL_NCCL_API(ncclResult_t, ncclCommAbort, (ncclComm_t comm))
OXCCL_NCCL_API(ncclResult_t, ncclCommRevoke, (ncclComm_t comm, int revokeFlags))
OXCCL_NCCL_API(ncclResult_t, ncclCommSplit,
               (ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config))
OXCCL_NCCL_API(ncclResult_t, ncclCommShrink,
               (ncclComm_t comm, int *excludeRanksList, int excludeRanksCount, ncclComm_t *newcomm,
                ncclConfig_t *config, int shrinkFlags))
OXCCL_NCCL_API(ncclResult_t, ncclCommGetUniqueId, (ncclComm_t comm, ncclUniqueId *uniqueId))
OXCCL_NCCL_API(ncclResult_t, ncclCommGrow,
               (ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId, int rank,
                ncclComm_t *newcomm, ncclConfig_t *config))
OXCCL_NCCL_API(ncclResult_t, ncclCommInitRankScalable,
               (ncclComm_t *newcomm, int nranks, int myrank, int nId, ncclUniqueId *commIds,
                ncclConfig_t *config))
OXCCL_NCCL_API(const char *, ncclGetErrorString, (ncclResult_t result))
OXCCL_NCCL_API(const char *, ncclGetLastError, (ncclComm_t comm))
OXCCL_NCCL_API(void, ncclResetDebugInit, (void))
OXCCL_NCCL_API(ncclResult_t, ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t *asyncError))
OXCCL_NCCL_API(ncclResult_t, ncclCommCount, (const ncclComm_t comm, int *count))
OXCCL_NCCL_API(ncclResult_t, ncclCommCuDevice, (const ncclComm_t comm, int *device))
OXCCL_NCCL_API(ncclResult_t, ncclCommUserRank, (const ncclComm_t comm, int *rank))
OXCCL_NCCL_API(ncclResult_t, ncclCommRegister,
               (const ncclComm_t comm, void *buff, size_t size, void **handle))
OXCCL_NCCL_API(ncclResult_t, ncclCommDeregister, (const ncclComm_t comm, void *handle))
OXCCL_NCCL_API(ncclResult_t, ncclCommSuspend, (ncclComm_t comm, int flags))
OXCCL_NCCL_API(ncclResult_t, ncclCommResume, (ncclComm_t comm))
OXCCL_NCCL_API(ncclResult_t, ncclCommMemStats,
               (ncclComm_t comm, ncclCommMemStat_t stat, uint64_t *value))
OXCCL_NCCL_API(ncclResult_t, ncclCommWindowRegister,
               (ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win, int winFlags))
OXCCL_NCCL_API(ncclResult_t, ncclCommWindowDeregister, (ncclComm_t comm, ncclWindow_t win))
OXCCL_NCCL_API(ncclResult_t, ncclWinGetUserPtr,
               (ncclComm_t comm, ncclWindow_t win, void **outUserPtr))
OXCCL_NCCL_API(ncclResult_t, ncclRedOpCreatePreMulSum,
               (ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                ncclScalarResidence_t residence, ncclComm_t comm))
OXCCL_NCCL_API(ncclResult_t, ncclRedOpDestroy, (ncclRedOp_t op, ncclComm_t comm))
OXCCL_NCCL_API(ncclResult_t, ncclReduce,
               (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclBcast,
               (void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclBroadcast,
               (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                int root, ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclAllReduce,
               (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclReduceScatter,
               (const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclAllGather,
               (const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclAlltoAll,
               (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclGather,
               (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                int root, ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclScatter,
               (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                int root, ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclSend,
               (const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclRecv,
               (void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclPutSignal,
               (const void *localbuff, size_t count, ncclDataType_t datatype, int peer,
                ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx,
                unsigned int flags, ncclComm_t comm, cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclSignal,
               (int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm,
                cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclWaitSignal,
               (int nDesc, ncclWaitSignalDesc_t *signalDescs, ncclComm_t comm,
                cudaStream_t stream))
OXCCL_NCCL_API(ncclResult_t, ncclGroupStart, (void))
OXCCL_NCCL_API(ncclResult_t, ncclGroupEnd, (void))
OXCCL_NCCL_API(ncclResult_t, ncclGroupSimulateEnd, (ncclSimInfo_t *simInfo))
OXCCL_NCCL_API(ncclResult_t, ncclParamBind, (ncclParamHandle_t *out, const char *key))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetI8, (ncclParamHandle_t h, int8_t *out))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetI16, (ncclParamHandle_t h, int16_t *out))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetI32, (ncclParamHandle_t h, int32_t *out))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetI64, (ncclParamHandle_t h, int64_t *out))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetU8, (ncclParamHandle_t h, uint8_t *out))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetU16, (ncclParamHandle_t h, uint16_t *out))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetU32, (ncclParamHandle_t h, uint32_t *out))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetU64, (ncclParamHandle_t h, uint64_t *out))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetStr, (ncclParamHandle_t h, const char **out))
OXCCL_NCCL_API(ncclResult_t, ncclParamGet, (ncclParamHandle_t h, void *out, int maxLen, int *len))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetParameter,
               (const char *key, const char **value, int *valueLen))
OXCCL_NCCL_API(ncclResult_t, ncclParamGetAllParameterKeys, (const char ***table, int *tableLen))
OXCCL_NCCL_API(void, ncclParamDumpAll, (void))

#undef OXCCL_NCCL_API

#ifdef __cplusplus
}
#endif
#endif
