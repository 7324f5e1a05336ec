/*
 * Compile-only check that the vendored ABI in nvtx_abi.h matches the real NVTX v3 headers.
 * Build with: gcc -std=c11 -fsyntax-only -I<dir containing nvtx3/> layout_check.c
 * A mismatch fails compilation; nothing is linked or run.
 */
#include <nvtx3/nvToolsExt.h>
#include "nvtx_abi.h"

#define SAME(a, b) _Static_assert((long long)(a) == (long long)(b), #a " != " #b)

SAME(DK_NVTX_MESSAGE_UNKNOWN, NVTX_MESSAGE_UNKNOWN);
SAME(DK_NVTX_MESSAGE_TYPE_ASCII, NVTX_MESSAGE_TYPE_ASCII);
SAME(DK_NVTX_MESSAGE_TYPE_UNICODE, NVTX_MESSAGE_TYPE_UNICODE);
SAME(DK_NVTX_MESSAGE_TYPE_REGISTERED, NVTX_MESSAGE_TYPE_REGISTERED);

SAME(sizeof(dk_nvtxEventAttributes_t), sizeof(nvtxEventAttributes_t));
SAME(offsetof(dk_nvtxEventAttributes_t, version), offsetof(nvtxEventAttributes_t, version));
SAME(offsetof(dk_nvtxEventAttributes_t, size), offsetof(nvtxEventAttributes_t, size));
SAME(offsetof(dk_nvtxEventAttributes_t, category), offsetof(nvtxEventAttributes_t, category));
SAME(offsetof(dk_nvtxEventAttributes_t, colorType), offsetof(nvtxEventAttributes_t, colorType));
SAME(offsetof(dk_nvtxEventAttributes_t, color), offsetof(nvtxEventAttributes_t, color));
SAME(offsetof(dk_nvtxEventAttributes_t, payloadType), offsetof(nvtxEventAttributes_t, payloadType));
SAME(offsetof(dk_nvtxEventAttributes_t, payload), offsetof(nvtxEventAttributes_t, payload));
SAME(offsetof(dk_nvtxEventAttributes_t, messageType), offsetof(nvtxEventAttributes_t, messageType));
SAME(offsetof(dk_nvtxEventAttributes_t, message), offsetof(nvtxEventAttributes_t, message));
SAME(sizeof(dk_nvtxMessageValue_t), sizeof(nvtxMessageValue_t));
SAME(sizeof(dk_nvtxRangeId_t), sizeof(nvtxRangeId_t));

SAME(DK_NVTX_CB_MODULE_CORE, NVTX_CB_MODULE_CORE);
SAME(DK_NVTX_CB_MODULE_CORE2, NVTX_CB_MODULE_CORE2);

SAME(DK_NVTX_CBID_CORE_MarkEx, NVTX_CBID_CORE_MarkEx);
SAME(DK_NVTX_CBID_CORE_MarkA, NVTX_CBID_CORE_MarkA);
SAME(DK_NVTX_CBID_CORE_MarkW, NVTX_CBID_CORE_MarkW);
SAME(DK_NVTX_CBID_CORE_RangeStartEx, NVTX_CBID_CORE_RangeStartEx);
SAME(DK_NVTX_CBID_CORE_RangeStartA, NVTX_CBID_CORE_RangeStartA);
SAME(DK_NVTX_CBID_CORE_RangeStartW, NVTX_CBID_CORE_RangeStartW);
SAME(DK_NVTX_CBID_CORE_RangeEnd, NVTX_CBID_CORE_RangeEnd);
SAME(DK_NVTX_CBID_CORE_RangePushEx, NVTX_CBID_CORE_RangePushEx);
SAME(DK_NVTX_CBID_CORE_RangePushA, NVTX_CBID_CORE_RangePushA);
SAME(DK_NVTX_CBID_CORE_RangePushW, NVTX_CBID_CORE_RangePushW);
SAME(DK_NVTX_CBID_CORE_RangePop, NVTX_CBID_CORE_RangePop);

SAME(DK_NVTX_CBID_CORE2_DomainMarkEx, NVTX_CBID_CORE2_DomainMarkEx);
SAME(DK_NVTX_CBID_CORE2_DomainRangeStartEx, NVTX_CBID_CORE2_DomainRangeStartEx);
SAME(DK_NVTX_CBID_CORE2_DomainRangeEnd, NVTX_CBID_CORE2_DomainRangeEnd);
SAME(DK_NVTX_CBID_CORE2_DomainRangePushEx, NVTX_CBID_CORE2_DomainRangePushEx);
SAME(DK_NVTX_CBID_CORE2_DomainRangePop, NVTX_CBID_CORE2_DomainRangePop);
SAME(DK_NVTX_CBID_CORE2_DomainRegisterStringA, NVTX_CBID_CORE2_DomainRegisterStringA);
SAME(DK_NVTX_CBID_CORE2_DomainRegisterStringW, NVTX_CBID_CORE2_DomainRegisterStringW);
SAME(DK_NVTX_CBID_CORE2_DomainCreateA, NVTX_CBID_CORE2_DomainCreateA);
SAME(DK_NVTX_CBID_CORE2_DomainCreateW, NVTX_CBID_CORE2_DomainCreateW);
SAME(DK_NVTX_CBID_CORE2_DomainDestroy, NVTX_CBID_CORE2_DomainDestroy);
SAME(DK_NVTX_CBID_CORE2_Initialize, NVTX_CBID_CORE2_Initialize);

SAME(DK_NVTX_ETID_CALLBACKS, NVTX_ETID_CALLBACKS);
SAME(DK_NVTX_ETID_VERSIONINFO, NVTX_ETID_VERSIONINFO);

SAME(sizeof(dk_NvtxExportTableCallbacks), sizeof(NvtxExportTableCallbacks));
SAME(offsetof(dk_NvtxExportTableCallbacks, GetModuleFunctionTable),
     offsetof(NvtxExportTableCallbacks, GetModuleFunctionTable));
SAME(sizeof(dk_NvtxExportTableVersionInfo), sizeof(NvtxExportTableVersionInfo));
SAME(offsetof(dk_NvtxExportTableVersionInfo, version), offsetof(NvtxExportTableVersionInfo, version));
SAME(offsetof(dk_NvtxExportTableVersionInfo, SetInjectionNvtxVersion),
     offsetof(NvtxExportTableVersionInfo, SetInjectionNvtxVersion));

/* The callback signatures must be assignment-compatible with the real function-pointer types. */
static dk_NvtxGetExportTableFunc_t check_get_export_table = (NvtxGetExportTableFunc_t)0;
static int (*check_get_module)(dk_NvtxCallbackModule, dk_NvtxFunctionTable *, unsigned int *) = 0;
typedef char check_fn_table_elem[sizeof(*(NvtxFunctionTable)0) == sizeof(*(dk_NvtxFunctionTable)0) ? 1 : -1];

int detkit_layout_check_unused(void) { return check_get_export_table == 0 && check_get_module == 0; }
