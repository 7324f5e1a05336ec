/*
 * Minimal NVTX v3 injection ABI, vendored for detkit's logging injection library.
 *
 * Why vendored: the `nvtx` PyPI wheel (0.2.17) ships only compiled extensions, not the
 * nvtx3 headers, and CI machines need not have a CUDA toolkit. These are the few types,
 * enum values and struct layouts that an injection library touches, copied by value from
 * NVTX v3 (nvtx3/nvToolsExt.h and nvtx3/nvtxDetail/nvtxTypes.h, Apache-2.0 WITH
 * LLVM-exception, (c) NVIDIA). Names carry a `dk_` / `DK_` prefix so that layout_check.c
 * can include this file next to the real headers and _Static_assert that every value and
 * offset agrees (tests/test_nvtx_injection.py runs that check wherever the headers exist).
 */
#ifndef DETKIT_NVTX_ABI_H
#define DETKIT_NVTX_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <wchar.h>

/* ---- client-visible types (nvToolsExt.h) ---- */

typedef uint64_t dk_nvtxRangeId_t;
typedef void *dk_nvtxDomainHandle_t;   /* opaque to clients; the tool chooses what it points to */
typedef void *dk_nvtxStringHandle_t;   /* idem */

enum {
    DK_NVTX_MESSAGE_UNKNOWN = 0,
    DK_NVTX_MESSAGE_TYPE_ASCII = 1,
    DK_NVTX_MESSAGE_TYPE_UNICODE = 2,
    DK_NVTX_MESSAGE_TYPE_REGISTERED = 3
};

typedef union dk_nvtxMessageValue_t {
    const char *ascii;
    const wchar_t *unicode;
    dk_nvtxStringHandle_t registered;
} dk_nvtxMessageValue_t;

typedef struct dk_nvtxEventAttributes_v2 {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t colorType;
    uint32_t color;
    int32_t payloadType;
    int32_t reserved0;
    union {
        uint64_t ullValue;
        int64_t llValue;
        double dValue;
        uint32_t uiValue;
        int32_t iValue;
        float fValue;
    } payload;
    int32_t messageType;
    dk_nvtxMessageValue_t message;
} dk_nvtxEventAttributes_t;

/* ---- callback subscription (nvtxDetail/nvtxTypes.h) ---- */

typedef enum dk_NvtxCallbackModule {
    DK_NVTX_CB_MODULE_INVALID = 0,
    DK_NVTX_CB_MODULE_CORE = 1,
    DK_NVTX_CB_MODULE_CUDA = 2,
    DK_NVTX_CB_MODULE_OPENCL = 3,
    DK_NVTX_CB_MODULE_CUDART = 4,
    DK_NVTX_CB_MODULE_CORE2 = 5,
    DK_NVTX_CB_MODULE_SYNC = 6,
    DK_NVTX_CB_MODULE_FORCE_INT = 0x7fffffff
} dk_NvtxCallbackModule;

enum {
    DK_NVTX_CBID_CORE_MarkEx = 1,
    DK_NVTX_CBID_CORE_MarkA = 2,
    DK_NVTX_CBID_CORE_MarkW = 3,
    DK_NVTX_CBID_CORE_RangeStartEx = 4,
    DK_NVTX_CBID_CORE_RangeStartA = 5,
    DK_NVTX_CBID_CORE_RangeStartW = 6,
    DK_NVTX_CBID_CORE_RangeEnd = 7,
    DK_NVTX_CBID_CORE_RangePushEx = 8,
    DK_NVTX_CBID_CORE_RangePushA = 9,
    DK_NVTX_CBID_CORE_RangePushW = 10,
    DK_NVTX_CBID_CORE_RangePop = 11
};

enum {
    DK_NVTX_CBID_CORE2_DomainMarkEx = 1,
    DK_NVTX_CBID_CORE2_DomainRangeStartEx = 2,
    DK_NVTX_CBID_CORE2_DomainRangeEnd = 3,
    DK_NVTX_CBID_CORE2_DomainRangePushEx = 4,
    DK_NVTX_CBID_CORE2_DomainRangePop = 5,
    DK_NVTX_CBID_CORE2_DomainRegisterStringA = 10,
    DK_NVTX_CBID_CORE2_DomainRegisterStringW = 11,
    DK_NVTX_CBID_CORE2_DomainCreateA = 12,
    DK_NVTX_CBID_CORE2_DomainCreateW = 13,
    DK_NVTX_CBID_CORE2_DomainDestroy = 14,
    DK_NVTX_CBID_CORE2_Initialize = 15
};

enum {
    DK_NVTX_ETID_CALLBACKS = 1,
    DK_NVTX_ETID_VERSIONINFO = 3
};

typedef void (*dk_NvtxFunctionPointer)(void);
/* An array of pointers to the NVTX instance's function-pointer slots, indexed by CBID. */
typedef dk_NvtxFunctionPointer **dk_NvtxFunctionTable;

typedef struct dk_NvtxExportTableCallbacks {
    size_t struct_size;
    int (*GetModuleFunctionTable)(dk_NvtxCallbackModule module, dk_NvtxFunctionTable *out_table,
                                  unsigned int *out_size);
} dk_NvtxExportTableCallbacks;

typedef struct dk_NvtxExportTableVersionInfo {
    size_t struct_size;
    uint32_t version;
    uint32_t reserved0;
    void (*SetInjectionNvtxVersion)(uint32_t version);
} dk_NvtxExportTableVersionInfo;

typedef const void *(*dk_NvtxGetExportTableFunc_t)(uint32_t exportTableId);

#endif /* DETKIT_NVTX_ABI_H */
